"""Past one instance: engine instances hosted as Ray actors, a dispatcher that spreads requests over
them by load and cached prefixes, and recovery of the requests of an instance that dies.

- `config.py`: `ClusterConfig`, the cluster's knobs.
- `dispatch.py`: the dispatch policies, pure functions of the instances' reports (no torch, no Ray).
- `ray_engine.py`: the Ray actor that hosts an engine loop, and the front end's connection to it.
- `rebalance.py` / `migrator.py`: the migration policy, and its rounds against a front end.
- `build.py`: how a cluster is put together (`build_cluster`, for the server and the simulator;
  `start_engines`, the server's Ray start and engine client).
"""
