"""Runs ``vllm.LLM(model=DIR).generate()`` greedily on token prompts and prints the tokens
as JSON: one process per engine, as vLLM keeps one engine's state per process. With a
dtype (``float16``) it prints the prompts' logprobs instead (each token's, given those
before it), which depend on no sampled token. With ``tp=N`` the model is split over N
cards (vLLM's tensor parallelism: a worker process per card); ``max_model_len=N`` sets the
model's longest length (256 otherwise). With ``faults`` it then
injects card faults into a prefill step and into a decode step (the project's fault
injection, through vLLM's ``collective_rpc``) and prints how each step's requests ended,
and a request served after."""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _fault_phases(llm, params, prompts, rank: str = "") -> dict:
    """Two requests whose prefill step the card fails; two whose first decode step it fails
    (a replay); two whose second decode step fails at its last command (after the step's
    collectives, on several cards); then one request alone. With `rank`, only that rank's
    card fails."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    ended = {}

    def add(tag: str, prompt) -> None:
        engine.add_request(tag, TokensPrompt(prompt_token_ids=prompt), params)

    def step_until_done() -> None:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    ended[out.request_id] = [out.outputs[0].finish_reason, len(out.outputs[0].token_ids)]

    for i, p in enumerate(prompts[:2]):
        add(f"prefill-{i}", p)
    llm.collective_rpc("inject_card_fault", args=("command", "3", rank))
    step_until_done()
    for i, p in enumerate(prompts[2:4]):
        add(f"decode-{i}", p)
    engine.step()                                      # their prefill: a first token each
    llm.collective_rpc("inject_card_fault", args=("command", "20", rank))
    step_until_done()
    for i, p in enumerate(prompts[2:4]):
        add(f"late-{i}", p)
    engine.step()                                      # their prefill
    card = int(rank or 0)
    before = llm.collective_rpc("card_counters")[card]["commands"]
    engine.step()                                      # a decode step: its commands counted
    commands = int(llm.collective_rpc("card_counters")[card]["commands"] - before)
    llm.collective_rpc("inject_card_fault", args=("command", str(commands - 1), rank))
    step_until_done()
    after = list(llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params)[0].outputs[0].token_ids)
    return {"ended": ended, "after": after}


def main() -> None:
    model_dir, prompts_json, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    extra = sys.argv[4:]
    dtype = next((a for a in extra if a.startswith("float")), None)
    tp = int(next((a for a in extra if a.startswith("tp=")), "tp=1")[3:])
    max_model_len = int(next((a for a in extra if a.startswith("max_model_len=")), "max_model_len=256")[14:])
    prompts = json.loads(prompts_json)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    llm = LLM(model=model_dir, dtype=dtype or "float32", max_model_len=max_model_len, gpu_memory_utilization=0.002,
              max_num_seqs=4, max_num_batched_tokens=128, tensor_parallel_size=tp)

    def stats() -> list[dict]:   # each rank's decode graphs
        return llm.collective_rpc("decode_graph_stats")

    started = stats()   # captures (and vLLM's warm-up runs) at start-up
    if dtype is not None:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        logprobs = [[lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], p[1:], strict=True)]
                    for o, p in zip(outs, prompts, strict=True)]
        print("RESULT " + json.dumps({"platform": type(current_platform).__qualname__, "prompt_logprobs": logprobs}))
        return
    # min_tokens keeps the end-of-sequence token from being chosen, as Hugging Face's
    # min_new_tokens does in the reference
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, min_tokens=max_tokens)
    alone = [list(llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params)[0].outputs[0].token_ids)]
    together = [list(o.outputs[0].token_ids)
                for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)]
    result = {"platform": type(current_platform).__qualname__, "alone": alone, "together": together,
              "decode": [{"captures": before["captures"], **{k: after[k] - before[k] for k in ("replays", "compiled")},
                          "contexts": {n: after["contexts"][n] - before["contexts"].get(n, 0) for n in after["contexts"]}}
                         for before, after in zip(started, stats(), strict=True)]}
    if "faults" in extra:
        # on several cards, the last rank's alone: not the rank whose report reaches the engine
        result["faults"] = _fault_phases(llm, params, prompts, str(tp - 1) if tp > 1 else "")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
