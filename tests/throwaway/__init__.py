"""A throwaway algorithm added exactly as docs/algorithms/adding.md says (outside hetfed: HETFED_ALGORITHMS).

Shrink: the server sends back the plain mean of the organizations' classifier heads times ``shrink``; each
organization reports the norm of the head it received. Only tests/e2e/test_throwaway_algorithm.py uses it.
"""
