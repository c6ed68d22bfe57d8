"""Benchmarks that show what prefix-aware serving buys: workloads, an OpenAI streaming client, the systems compared.

Run by hand (`python -m bench.run`), not by the test suite; it writes a JSON file and a markdown report.
"""
