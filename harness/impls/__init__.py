"""Implementations under test. See `harness.impls.registry`."""
from harness.impls.registry import Impl, register, get, all_impls, implementations_for, load_spec  # noqa: F401
