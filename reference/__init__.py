"""The spec: every mixer op, cache layout and weight loader in plain PyTorch.

Plain loops over tokens, any float dtype (float64 for oracles), packed varlen input through
`cu_seqlens`, optional initial state in and final state out. Nothing here imports `harness`.

Layout convention for every op in this package: tensors are *token-major and packed*:
the first dimension is the token index over all sequences concatenated (T tokens), and
`cu_seqlens` (int, shape (S+1,), starts at 0, non-decreasing, ends at T) splits them into S
sequences. `cu_seqlens=None` means one sequence of all T tokens. Per-sequence states have
the sequence index first: (S, ...).
"""
