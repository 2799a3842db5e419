"""The HTTP/2 stream windows and read caps of the gRPC transport, apart from it so that configuration can name
them without importing gRPC (the aggregator's run core imports none)."""

# What a connection's socket reads are capped at, whatever its window: gRPC sizes a connection's read buffer
# to the largest read it has seen and keeps it between reads (the aggregator's idle connections).
READ_CAP_BYTES = 64 << 10
# The HTTP/2 receive window of every stream the aggregator receives, unless configured. gRPC asks for more of
# a stream once half its window has been read, so a stream moves about half a window per round trip when the
# link is slower to answer than that; and a stream the server does not read gets about two windows in (a
# push waiting for admission). 16 MiB moves a push at 0.9 of a 1 Gbit/s link's rate at 100 ms, and at the
# rate of a 1 Gbit/s link at 20 ms and of a 100 Mbit/s link at 100 ms (docs/benchmarks.md, "What the stream
# window costs a push"); a push waiting for admission holds at most about 2 x 16 + 1 MiB.
DEFAULT_WINDOW_BYTES = 16 << 20
# The window of what a client receives (pulls): one connection per client, nothing waits in it.
CHANNEL_WINDOW_BYTES = 32 << 20
