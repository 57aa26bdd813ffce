"""Machine-checked properties of kvcache, spec and the kernels' index arithmetic.

``python -m proofs.run`` (``make proofs``) checks, within bounds that are counts
(``bounded.py``), never durations:
CrossHair contracts on small pure functions, ``crosshair diffbehavior`` pairs
(spec versus kvcache, reference versus kernel formula) listed in ``manifest.py``,
and a bounded exhaustive comparison of the two managers (``exhaustive.py``).
"""
