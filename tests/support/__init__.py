"""What the test folders share: free ports and child processes (procs), the daemon and router processes
(servers), the dev cluster (cluster), the operator (operator) and the kernel cases (kernel_cases).
tests/conftest.py registers the modules that hold fixtures as plugins (`pytest_plugins`), so every
folder sees those fixtures without a conftest importing another.

tests/ is on sys.path in a test run (`pythonpath` in pyproject.toml), so this package is `support`;
the checkout itself never is (its operator/, daemon/ and kernels/ would shadow other modules)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
