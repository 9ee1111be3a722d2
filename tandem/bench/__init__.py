"""`tandem bench`: serving (online, any OpenAI-compatible endpoint) and offline throughput benchmarks."""
