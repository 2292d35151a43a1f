"""The reference registered as an implementation (`--impl reference`): the float64-capable spec run as
an implementation under test, so the suites exercise their own plumbing on any machine."""
from harness.impls.registry import Impl, register

register(Impl(name="reference", ops={}, devices=("cpu", "cuda", "xpu"),
              description="reference/ plain loops (the spec)"))
