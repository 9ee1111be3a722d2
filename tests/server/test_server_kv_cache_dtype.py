"""`tandem serve --kv-cache-dtype int8`: the engine holds an int8 cache and serves what the offline
engine with the same cache produces, through the real openai client."""

from __future__ import annotations

from server_utils import FAST_ARGS, RemoteServer

from tandem import LLM, SamplingParams


def test_serves_with_an_int8_cache(llama_dir) -> None:
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(40, 75))]
    offline = LLM(str(llama_dir), kv_cache_dtype="int8", num_kv_blocks=128, max_num_seqs=8, num_threads=1)
    expected = offline.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    with RemoteServer(llama_dir, *FAST_ARGS, "--kv-cache-dtype", "int8") as server:
        assert "KV cache int8" in server.logs()  # the engine's start-up line names its cache format
        client = server.client()
        for prompt, want in zip(prompts, expected):
            got = client.completions.create(
                model=str(llama_dir),
                prompt=prompt,
                max_tokens=10,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert got.choices[0].text == want.outputs[0].text
