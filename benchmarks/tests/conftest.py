"""The benchmarks' tests, beside the scripts they check: each file opens with a docstring that
lists what it checks. They share the test suite's pytest plugin and helpers with tests/
(tests/support/suite.py: the `gpu` marker's skip, the Triton interpreter without CUDA, the
`benchmark_script` fixture; pyproject's `pythonpath` puts tests/support on sys.path)."""

pytest_plugins = ["suite"]
