"""Tensor codec throughput on a ~100 MB ModelWeights, next to plain memory copies of the same bytes.

    python benchmarks/codec_throughput.py [--size-mb 100] [--repeat 7] [--allocator both|default|warm]

Every figure here is dominated by memory: a copy into fresh memory pays a page fault per 4 KiB
page, which costs more than the copy itself. glibc returns large freed blocks to the kernel, so with
its default settings every large ``bytes`` object is fresh memory; with ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` raised (the ``warm`` allocator) freed memory is reused. The benchmark runs
itself once under each allocator (in a child process, since glibc reads these at start-up) and
prints both tables.

What is timed (best of ``--repeat``, after one warm-up; MB = 10^6 bytes of float32 tensor data):

* memcpy baselines over the same bytes: ``np.copyto`` into a preallocated, already touched buffer
  (the machine's copy bandwidth) and ``bytes(memoryview)`` into a fresh buffer (one copy plus the
  page faults of new memory, which every encoder that produces new bytes also pays);
* the codec alone: ``payload_to_proto`` (encode) and ``payload_from_proto`` (decode);
* the codec with Protobuf serialization: encode + ``SerializeToString`` and ``FromString`` + decode;
* what a client sends: ``messages.encode_update`` (the payload laid out and each tensor written once into
  the message's one buffer by ``hetfed.wire.serialize``), whose bytes must equal encode + ``SerializeToString``
  of the same Update.

Each line prints MB/s and the ratio to both memcpy baselines; the goal is a codec at least 1/3 as
fast as a memory copy. The result is checked for equality after the timings.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import payloads_pb2 as pb
from hetfed.wire import codec, messages
from hetfed.wire.payloads import ModelWeights


def realistic_shapes(size_mb: float) -> dict[str, tuple[int, ...]]:
    """~50 parameter shapes of a conv + transformer-style model, scaled to ``size_mb`` MB of float32."""
    base: dict[str, tuple[int, ...]] = {"stem.conv.weight": (64, 3, 7, 7), "stem.bn.weight": (64,),
                                        "stem.bn.bias": (64,)}
    for i, c in enumerate((64, 128, 256, 512)):
        base[f"stage{i}.conv1.weight"] = (c, c, 3, 3)
        base[f"stage{i}.bn1.weight"] = (c,)
        base[f"stage{i}.bn1.bias"] = (c,)
        base[f"stage{i}.conv2.weight"] = (c, c, 3, 3)
        base[f"stage{i}.bn2.weight"] = (c,)
        base[f"stage{i}.bn2.bias"] = (c,)
    for i in range(6):
        base[f"block{i}.attn.qkv.weight"] = (3 * 768, 768)
        base[f"block{i}.attn.qkv.bias"] = (3 * 768,)
        base[f"block{i}.mlp.fc.weight"] = (3072, 768)
        base[f"block{i}.mlp.fc.bias"] = (3072,)
    base["embed.weight"] = (8192, 768)
    base["head.weight"] = (1000, 768)
    base["head.bias"] = (1000,)
    elements = sum(int(np.prod(s)) for s in base.values())
    # Scale the leading dimension of every matrix/conv weight so the total lands near size_mb.
    factor = size_mb * 1e6 / 4 / elements
    out = {}
    for name, shape in base.items():
        if len(shape) >= 2:
            out[name] = (max(1, round(shape[0] * factor)), *shape[1:])
        else:
            out[name] = shape
    return out


def make_weights(size_mb: float, seed: int = 0) -> ModelWeights:
    """A ModelWeights of ~``size_mb`` MB of float32 tensors with random values."""
    rng = np.random.default_rng(seed)
    tensors = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in realistic_shapes(size_mb).items()}
    return ModelWeights(tensors, num_examples=1234)


def best_time(fn: Callable[[], Any], repeat: int) -> float:
    """Best wall time of ``fn`` over ``repeat`` runs after one warm-up; results are freed between runs."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
        del result
    return best


# glibc tunables of the "warm" allocator: large blocks come from the heap and stay there once freed.
WARM_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 34),
                   "MALLOC_TOP_PAD_": str(1 << 29)}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark under the chosen allocator(s) and print one table each."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=100.0)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--allocator", choices=("both", "default", "warm"), default="both")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return measure(args.size_mb, args.repeat)
    print(f"$ python benchmarks/codec_throughput.py --size-mb {args.size_mb:g} --repeat {args.repeat} "
          f"--allocator {args.allocator}", flush=True)
    kinds = ("default", "warm") if args.allocator == "both" else (args.allocator,)
    for kind in kinds:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        if kind == "warm":
            env.update(WARM_MALLOC_ENV)
        settings = " ".join(f"{k}={v}" for k, v in WARM_MALLOC_ENV.items()) if kind == "warm" else "glibc defaults"
        print(f"\n== allocator: {kind} ({settings})", flush=True)
        cmd = [sys.executable, __file__, "--child", "--size-mb", str(args.size_mb), "--repeat", str(args.repeat)]
        rc = subprocess.call(cmd, env=env)
        if rc:
            return rc
    return 0


def measure(size_mb: float, repeat: int) -> int:
    """Time the codec and the memcpy baselines in this process and print one line per measurement."""
    args = argparse.Namespace(size_mb=size_mb, repeat=repeat)
    weights = make_weights(args.size_mb)
    n_bytes = sum(a.nbytes for a in weights.tensors.values())
    mb = n_bytes / 1e6
    print(f"python {platform.python_version()}, numpy {np.__version__}, "
          f"protobuf {pb.DESCRIPTOR.__class__.__module__.split('.')[0]} "
          f"{__import__('google.protobuf').protobuf.__version__} "
          f"({__import__('google.protobuf.internal.api_implementation', fromlist=['x']).Type()}), "
          f"{os.cpu_count()} CPUs")
    print(f"ModelWeights: {len(weights.tensors)} float32 tensors, {mb:.1f} MB "
          f"(largest {max(a.nbytes for a in weights.tensors.values()) / 1e6:.1f} MB, "
          f"smallest {min(a.nbytes for a in weights.tensors.values())} B)")

    flat = np.concatenate([a.ravel() for a in weights.tensors.values()])
    dst = np.empty_like(flat)
    dst[:] = 0  # touch every page: copyto measures bandwidth, not page faults
    view = memoryview(flat).cast("B")
    t_copyto = best_time(lambda: np.copyto(dst, flat), args.repeat)
    t_bytes = best_time(lambda: bytes(view), args.repeat)

    msg = codec.payload_to_proto(weights)
    wire = msg.SerializeToString()
    t_enc = best_time(lambda: codec.payload_to_proto(weights), args.repeat)
    t_dec = best_time(lambda: codec.payload_from_proto(msg), args.repeat)
    t_ser = best_time(lambda: codec.payload_to_proto(weights).SerializeToString(), args.repeat)
    t_par = best_time(lambda: codec.payload_from_proto(pb.Payload.FromString(wire)), args.repeat)

    update = messages.Update("run", 1, "org", [weights])
    t_upd = best_time(lambda: messages.encode_update(update), args.repeat)
    whole = apb.Update(envelope=apb.Envelope(run_id="run", round=1, organization_id="org",
                                             payload_kinds=[weights.kind.proto_enum]))  # type: ignore[list-item]
    whole.payloads.add().CopyFrom(msg)
    assert bytes(messages.encode_update(update).data) == whole.SerializeToString()
    del whole

    back = codec.payload_from_proto(pb.Payload.FromString(wire))
    assert isinstance(back, ModelWeights) and back.num_examples == weights.num_examples
    assert list(back.tensors) == list(weights.tensors)
    for name, arr in weights.tensors.items():
        np.testing.assert_array_equal(back.tensors[name], arr)

    rows = [
        ("memcpy: np.copyto into a touched buffer", t_copyto),
        ("memcpy: bytes(memoryview), fresh buffer", t_bytes),
        ("codec encode  (payload_to_proto)", t_enc),
        ("codec decode  (payload_from_proto)", t_dec),
        ("codec encode+decode", t_enc + t_dec),
        ("encode + SerializeToString", t_ser),
        ("FromString + decode", t_par),
        ("full round trip (serialize + parse)", t_ser + t_par),
        ("encode_update (serializer, one buffer)", t_upd),
    ]
    print(f"{'measurement':<42}{'MB/s':>10}{'vs copyto':>11}{'vs bytes()':>12}")
    for label, t in rows:
        rate = mb / t
        print(f"{label:<42}{rate:>10.0f}{t_copyto / t:>11.2f}{t_bytes / t:>12.2f}")
    ratio = t_bytes / (t_enc + t_dec)
    goal = "meets" if ratio >= 1 / 3 else "MISSES"
    strict = t_copyto / (t_enc + t_dec)
    print(f"codec encode+decode: {ratio:.2f}x a fresh-buffer copy ({goal} the 1/3 goal), "
          f"{strict:.2f}x np.copyto into touched memory; encode {t_bytes / t_enc:.2f}x, "
          f"decode {t_bytes / t_dec:.2f}x a fresh-buffer copy", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
