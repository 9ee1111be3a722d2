"""A discrete-event simulator of a Tandem cluster that runs the real scheduler, KV cache manager, prefix
cache and global dispatch/migration code with a step-time model in place of the model, so that policies
can be compared on hours of production-like traffic (tandem.sim.trace: Azure and Mooncake traces,
synthetic workloads) in seconds and without an accelerator.
"""
