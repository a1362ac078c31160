"""A toy byte-level GPT trainer that compares flash and dense attention: `python -m train --preset tiny`."""
