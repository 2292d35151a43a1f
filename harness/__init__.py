"""ssm-harness: implementations under test, engine, checks, records, benchmarks, report, gate, CLI."""
__version__ = "0.1.0"
