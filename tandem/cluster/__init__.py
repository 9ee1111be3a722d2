"""Past one instance: engine instances hosted as Ray actors, a dispatcher that spreads requests over
them by load and cached prefixes, and recovery of the requests of an instance that dies.

- `config.py`: `ClusterConfig`, the cluster's knobs.
- `dispatch.py`: the dispatch policies, pure functions of the instances' reports (no torch, no Ray).
- `ray_engine.py`: the Ray actor that hosts an engine loop, and the front end's connection to it.
"""
