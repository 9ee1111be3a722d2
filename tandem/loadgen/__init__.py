"""`tandem bench`: serving (online, any OpenAI-compatible endpoint) and offline throughput benchmarks.

The load generator behind the `tandem bench` subcommands: datasets, arrivals, client-side latency
statistics, plots, and `server_process` (`tandem serve` as a child process, for tests and benchmarks).
The scripts that measure Tandem against its peers live in benchmarks/ at the repository root.
"""
