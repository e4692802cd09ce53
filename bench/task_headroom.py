"""Which tasks others wrote have headroom for the real model? Untrained scores, task by task.

    python bench/task_headroom.py                       # every candidate, 32 questions each
    python bench/task_headroom.py --tasks chain_sum gcd --questions 64 --samples 8

SmolLM2-135M-Instruct (prepared from its pip package) is served by `overnight serve` on
vLLM's CPU backend, and each candidate reasoning-gym task at an easy difficulty is asked
through the proxy, the way examples/reasoning_gym_agent.py asks it (its own messages: its
instruction, `--shots` worked examples of the task, the question; and its 64 tokens), `--samples` answers sampled at the traffic's temperature
(`--temperature`, seeded) and one greedy answer per question, each scored by the task's
own verifier (`score_answer`, strict: most verifiers give 0.01 for a wrong answer of the
right kind, 1.0 only for the exact answer). A task teaches GRPO something only where
sampled answers are sometimes right and sometimes not: the table marks a task `headroom`
when its sampled score lies in [--low, --high] and at least a quarter of its questions got
an exactly right and a wrong sampled answer (groups with a spread). `holds` is the share of
sampled answers that contain the expected answer somewhere (right, but not in the form the
verifier wants: what a night could teach as format). `constant` is the best score one fixed
answer gets over the questions (the commonest expected answer, say "False"): a night that
learns that answer looks like learning, so a task's rise is read against it. The questions come from a development seed
(--seed); the learning benchmark measures held-out scores on other seeds.

Progress lines with a rate and ETA; the table at the end, and --json FILE for the rows.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# The agent's own system prompt, so that what is measured here is what its traffic sees.
from examples.reasoning_gym_agent import task_messages, worked_examples  # noqa: E402

# Candidate tasks at easy settings (reasoning-gym 0.1.25's own config fields): sums and
# counts a 135M model might get right sometimes, yes/no questions, short string tasks.
CANDIDATES: dict[str, dict] = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "basic_arithmetic": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 1,
        "operators": ("+", "-"),
        "allow_parentheses": False,
        "allow_negation": False,
    },  # fmt: skip
    "products": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "leg_counting": {"min_animals": 1, "max_animals": 2, "min_instances": 1, "max_instances": 3},
    "letter_counting": {"min_words": 3, "max_words": 5},
    "spell_backward": {"min_word_len": 3, "max_word_len": 4},
    "word_sequence_reversal": {"min_words": 3, "max_words": 4},
    "gcd": {"min_value": 1, "max_value": 20},
    "lcm": {"min_value": 1, "max_value": 10},
    "count_bits": {"min_n": 1, "max_n": 32},
    "number_sorting": {
        "min_numbers": 3,
        "max_numbers": 4,
        "min_decimals": 0,
        "max_decimals": 0,
        "min_value": 0,
        "max_value": 50,
    },  # fmt: skip
    "number_filtering": {
        "min_numbers": 3,
        "max_numbers": 5,
        "min_decimals": 0,
        "max_decimals": 0,
        "min_value": 0,
        "max_value": 50,
    },  # fmt: skip
    "base_conversion": {"min_base": 2, "max_base": 10, "min_value": 0, "max_value": 16},
    "power_function": {"min_base": -5.0, "max_base": 5.0, "min_exponent": 0, "max_exponent": 2},
    "simple_equations": {"min_terms": 2, "max_terms": 2, "min_value": 1, "max_value": 10},
    "isomorphic_strings": {"min_string_length": 2, "max_string_length": 4},
    "ransom_note": {"min_note_length": 1, "max_note_length": 3, "max_magazine_length": 8},
    "syllogism": {},
    "coin_flip": {"min_trials": 3, "max_trials": 4},
    "needle_haystack": {"min_num_statements": 3, "max_num_statements": 5},
    "word_sorting": {"min_words": 3, "max_words": 4, "min_word_length": 3, "max_word_length": 6},
    "family_relationships": {"min_family_size": 4, "max_family_size": 4},
    "propositional_logic": {
        "min_vars": 2,
        "max_vars": 2,
        "min_statements": 2,
        "max_statements": 2,
        "min_complexity": 1,
        "max_complexity": 1,
    },  # fmt: skip
    "number_format": {
        "min_num_candidates": 2,
        "max_num_candidates": 2,
        "min_n": 1000,
        "max_n": 100000,
    },  # fmt: skip
    "binary_alternation": {"min_n": 2, "max_n": 6},
    "string_insertion": {"min_string_length": 5, "max_string_length": 6},
    "aiw": {"max_entities": 3},
}


def questions(task: str, count: int, seed: int) -> list[tuple[dict, object]]:
    """`count` questions of `task` at its candidate difficulty, and the dataset scoring them."""
    import reasoning_gym

    ds = reasoning_gym.create_dataset(task, size=count, seed=seed, **CANDIDATES[task])
    return [(ds[i], ds) for i in range(count)]


def ask(client, model: str, entry: dict, examples: list[dict], samples: int,
        temperature: float, seed: int, max_tokens: int) -> tuple[list[str], str]:  # fmt: skip
    """`samples` sampled answers and one greedy answer to one question."""
    messages = task_messages(entry["question"], examples)
    sampled = client.chat.completions.create(
        model=model, messages=messages, n=samples, temperature=temperature, seed=seed,
        max_tokens=max_tokens,
    )  # fmt: skip
    greedy = client.chat.completions.create(
        model=model, messages=messages, temperature=0.0, max_tokens=max_tokens
    )
    texts = [c.message.content or "" for c in sampled.choices]
    return texts, greedy.choices[0].message.content or ""


def score(ds, entry: dict, text: str) -> float:
    try:
        return float(ds.score_answer(text.strip(), entry))
    except Exception:  # a verifier that chokes on a malformed answer: a wrong answer
        return 0.0


def constant_score(asked: list[tuple[dict, object]]) -> float:
    """The best mean score of one fixed answer over the questions, among their expected
    answers: what a model that learned the commonest answer, and nothing else, gets."""
    answers = {str(entry["answer"]) for entry, _ in asked}
    return max(sum(score(ds, entry, a) for entry, ds in asked) / len(asked) for a in answers)


def measure(client, model: str, task: str, args) -> dict:
    asked = questions(task, args.questions, args.seed)
    examples = worked_examples(task, CANDIDATES[task], args.shots)

    def one(item):
        i, (entry, ds) = item
        texts, greedy = ask(client, model, entry, examples, args.samples, args.temperature,
                            args.seed * 1000 + i, args.max_tokens)  # fmt: skip
        holds = [str(entry["answer"]).strip().lower() in t.lower() for t in texts]
        return [score(ds, entry, t) for t in texts], score(ds, entry, greedy), greedy, holds

    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(one, enumerate(asked)))
    sampled = [s for scores, _, _, _ in results for s in scores]
    spread = sum(1 for scores, _, _, _ in results if max(scores) >= 1.0 > min(scores))
    holds = [h for _, _, _, hs in results for h in hs]
    return {
        "task": task,
        "difficulty": CANDIDATES[task],
        "sampled": sum(sampled) / len(sampled),
        "greedy": sum(g for _, g, _, _ in results) / len(results),
        "spread": spread / len(results),
        "holds": sum(holds) / len(holds),
        "constant": constant_score(asked),
        "example": {
            "question": asked[0][0]["question"][:200],
            "answer": asked[0][0]["answer"],
            "greedy": results[0][2][:120],
        },  # fmt: skip
    }


CONSTANT_AT_MOST = 0.4


def headroom(row: dict, low: float, high: float) -> bool:
    """In range, with spread, and one fixed answer scoring at most CONSTANT_AT_MOST: where
    it scores more (ransom_note's "False", 0.56), a night that learned that answer alone
    would pass for learning the task."""
    room = row["constant"] <= CONSTANT_AT_MOST
    return low <= row["sampled"] <= high and row["spread"] >= 0.25 and room


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="*", default=list(CANDIDATES))
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--shots", type=int, default=2, help="worked examples (the agent's)")
    parser.add_argument("--max-tokens", type=int, default=64)  # the agent's
    parser.add_argument("--seed", type=int, default=1, help="the development seed")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--low", type=float, default=0.05)
    parser.add_argument("--high", type=float, default=0.6)
    parser.add_argument("--model-dir", help="a prepared SmolLM2 (default: prepared now)")
    parser.add_argument("--url", help="a running proxy's base URL (…/v1) serving `smollm2`")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    unknown = [t for t in args.tasks if t not in CANDIDATES]
    if unknown:
        parser.error(f"no candidate difficulty for {unknown}: add them to CANDIDATES")
    from openai import OpenAI

    server = None
    # A SIGTERM stops the server it started too (the `finally` below), not only this process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.url is None:
        from overnight.models.smollm2 import prepare_smollm2
        from overnight.testing.processes import serve_local_model

        model_dir = args.model_dir or prepare_smollm2(ROOT / ".cache" / "smollm2-135m-instruct")
        data = tempfile.mkdtemp(prefix="headroom-")
        print(f"starting vLLM (CPU) on {model_dir} behind the proxy (data {data})", flush=True)
        server = serve_local_model(data, model_dir, "smollm2", "--vllm-arg=--max-model-len=2048")
        args.url = f"{server.url}/v1"
    client = OpenAI(base_url=args.url, api_key="unused", timeout=300)
    rows, started = [], time.monotonic()
    try:
        for done, task in enumerate(args.tasks, 1):
            rows.append(measure(client, "smollm2", task, args))
            row, spent = rows[-1], time.monotonic() - started
            eta = spent / done * (len(args.tasks) - done)
            print(f"[{done}/{len(args.tasks)}] {task}: sampled {row['sampled']:.3f} greedy "
                  f"{row['greedy']:.3f} spread {row['spread']:.2f} holds {row['holds']:.2f} "
                  f"constant {row['constant']:.2f} "
                  f"({spent / done:.0f} s a task, "
                  f"ETA {eta:.0f} s)", flush=True)  # fmt: skip
    finally:
        if server is not None:
            server.stop()
    print(f"\n{'task':24} {'sampled':>8} {'greedy':>7} {'spread':>7} {'holds':>6} "
          f"{'constant':>8}  verdict")  # fmt: skip
    for row in sorted(rows, key=lambda r: -r["sampled"]):
        verdict = "headroom" if headroom(row, args.low, args.high) else ""
        print(f"{row['task']:24} {row['sampled']:8.3f} {row['greedy']:7.3f} "
              f"{row['spread']:7.2f} {row['holds']:6.2f} {row['constant']:8.2f}  {verdict}")  # fmt: skip
    if args.json:
        for row in rows:
            row["headroom"] = headroom(row, args.low, args.high)
        args.json.write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
