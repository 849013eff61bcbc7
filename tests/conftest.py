"""The root of the test tree. Every file opens with a docstring that lists what it checks.

- unit/: one process, no process group, no Trainer: the config, the reference quantizer and
  ops, the Triton kernels against their twins (in Triton's CPU interpreter without CUDA), launch
  signatures, buffers, the schedule, window gradients, weight access and edits, simulated process
  groups, collective timeouts with fake handles, the simulation on a GPU; and the package as a
  user installs it (its layout, declared dependencies, README and CHANGELOG);
- multiprocess/: the engine and the compressed collectives on several gloo processes, without a
  Trainer: against the single-process simulation of the same math, applied shards, checkpoints at
  the engine's level (formats, writer locks, a full disk, a resume that changes something), ranks
  that build different models;
- integration/: the adapters under Lightning's Trainer and Fabric and the simulation strategy,
  mostly against DDP on the same seed (hooks, clipping, compile, buffers, guards, checkpoints
  through the Trainer, the bytes on the wire); the examples; and jobs started as a user starts
  them: launchers, preemption, a stalled rank, the namespace cluster;
- support/: the helpers that tests import by bare name (`from distributed import run_workers`;
  pyproject's `pythonpath` puts this folder first on sys.path), the scripts that tests start as
  subprocesses, and the suite's pytest plugin (support/suite.py: the `gpu` marker's skip, the
  Triton interpreter without CUDA, shared fixtures), loaded by this file and by
  benchmarks/tests/conftest.py;
- the benchmarks' tests are beside the scripts they check, in benchmarks/tests/.

Multi-process tests start their workers from a forkserver (support/distributed.py), which imports
a test's worker function by its module's name. The forkserver starts at the first such test and
copies sys.path then, after collection has put every test folder on it (pytest's default
`prepend` import mode), so test module names must be unique across all folders.

The whole suite (tests/ and benchmarks/tests/) takes about 10 minutes on 2 CPU cores (`make test`
after the install, 2026-12-04: 610 s), most of it in multi-process Lightning fits, the namespace
cluster, the stall and preemption jobs and the checkpoint fault injection; the forkserver makes
workers cheap, so nothing is marked slow."""

pytest_plugins = ["suite"]
