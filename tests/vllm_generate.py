"""Runs ``vllm.LLM(model=DIR).generate()`` greedily on token prompts and prints the tokens
as JSON: one process per engine, as vLLM keeps one engine's state per process. With a
dtype (``float16``) it prints the prompts' logprobs instead (each token's, given those
before it), which depend on no sampled token."""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    model_dir, prompts_json, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dtype = sys.argv[4] if len(sys.argv) > 4 else None
    prompts = json.loads(prompts_json)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    llm = LLM(model=model_dir, dtype=dtype or "float32", max_model_len=256, gpu_memory_utilization=0.002,
              max_num_seqs=8)
    if dtype is not None:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        logprobs = [[lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], p[1:], strict=True)]
                    for o, p in zip(outs, prompts, strict=True)]
        print("RESULT " + json.dumps({"platform": type(current_platform).__qualname__, "prompt_logprobs": logprobs}))
        return
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    alone = [list(llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params)[0].outputs[0].token_ids)]
    together = [list(o.outputs[0].token_ids)
                for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)]
    from spyre_rt.serving.graphs import STATS

    print("RESULT " + json.dumps({"platform": type(current_platform).__qualname__,
                                  "alone": alone, "together": together, "decode": STATS}))


if __name__ == "__main__":
    main()
