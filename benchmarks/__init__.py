"""The benchmark harness (`python -m benchmarks`): suites, timing, inputs, implementations under test, reports."""
