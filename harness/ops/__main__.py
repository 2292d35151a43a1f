"""`python -m harness.ops`: every op of the contract with its signature and semantics."""
from harness.ops import SPECS

for s in SPECS.values():
    print(s.doc.strip(), end="\n\n")
