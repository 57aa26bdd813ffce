"""The conformance and benchmarking kit: put any KV-cache manager on trial.

Nothing here is imported by ``kvcache`` itself; the manager stays free of it.

* ``config``     — ``ManagerConfig`` / ``GroupConfig``: a manager as plain data;
* ``sides``      — implementation names (``--impl``), adapters (``adapter_base``),
  and ``Side``, which drives one manager by named calls;
* ``vllm_side``  — the adapter for the installed vLLM (0.25.1 is the reference);
* ``trace``      — the trace file format (docs/trace-format.md);
* ``driver``     — the random scheduler, lockstep comparison, shrinking, replay;
* ``record``     — traces of the scheduler simulation or of random sequences;
* ``fuzz``       — fuzzing campaigns with a progress bar and counterexamples;
* ``workloads``, ``adapters``, ``bench`` — workloads, the simulation, benchmarks;
* ``cli``        — ``python -m kvcache`` (the ``kvcache`` command; its commands by job
  in ``cli_trial``, ``cli_releases``, ``cli_effectiveness``, its checks in ``cli_args``).
"""
