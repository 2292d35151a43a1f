"""Makes `pytest suites/` work from a checkout: loads the harness pytest plugin.

When the package is installed, the plugin is already registered through the `pytest11`
entry point named `harness.testing.plugin`, and this line is a no-op.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest_plugins = ["harness.testing.plugin"]
