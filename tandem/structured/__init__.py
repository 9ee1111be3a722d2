"""Structured output: grammars compiled from a request's `StructuredOutputsParams`, one matcher per
sample that follows its tokens, and the per-step token bitmask the sampler applies (see
docs/architecture.md). The engine owns this state; the worker reads it through `GrammarHook`."""
