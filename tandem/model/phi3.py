"""Phi-3 (Phi-3, Phi-3.5, Phi-4-mini): the Llama architecture with its q/k/v and gate/up projections
already fused in the checkpoint (loaded as they are), partial rotary where configured, and longrope
(tandem/model/rope.py) for its long-context versions."""

from __future__ import annotations

from tandem.model.llama import LlamaForCausalLM
from tandem.model.weights import Target


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_target(self, name: str) -> Target | None:
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied embeddings: some checkpoints store the copy anyway
        return Target(name.removeprefix("model."))

    def param_parts(self, param: str) -> list[Target]:
        return [Target(param)]
