"""A night on implicit rewards beside a night on the true reward, from one day of scripted
users talking to SmolLM2-135M-Instruct (vLLM on the CPU): how much of the posted gain do
the signals recover?

    python bench/implicit_nights.py                       # 48 conversations, 8 samples
    python bench/implicit_nights.py --conversations 96 --samples 16 --seed 11

The trial is overnight/testing/implicit_trial.py (its docstring says each step): the
day's answers are groups of one, each night trains them as lone turns against its pool
(trainer/choose/lone_turns.py), and the held-out sums are sampled from the base model and
both adapters with the same seeds. It prints the agreement of the implicit rewards with
the true ones (AUC), what each night trained, the held-out means, both gains and the
implicit night's share of the posted one's. Results: BENCHMARKS.md.

    python bench/implicit_nights.py --hindsight          # issue 48: learn from what they said

--hindsight runs the hindsight trial instead (implicit_trial.run_hindsight_trial): users
who correct a wrong answer with the right sum ("No, it's 7."), a night on the implicit
rewards beside an `overnight train --hindsight` night on the same day, the held-out share
answered right of the base model and both adapters, and each adapter's forgetting; and
a third night, `--hindsight --hindsight-mode distill` (the served answers and 4 resampled
siblings of each corrected turn, each token's advantage the teacher's logprob with the
hint minus the student's without, GRPO's loss). `--arms hindsight,distill` leaves the
implicit night out (the slowest: about 15 minutes here).
Run it under `flock /tmp/overnight-heavy.lock` where other heavy jobs share the machine.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8, help="per held-out sum, per model")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--hindsight", action="store_true", help="the hindsight trial")
    parser.add_argument(
        "--arms", default="implicit,hindsight,distill",
        help="--hindsight: the nights beside the base model, of implicit, hindsight (the "
        "revisions imitated) and distill (--hindsight-mode distill, with resampled siblings)",
    )  # fmt: skip
    args = parser.parse_args()

    from smollm2_vllm import CACHE, clock, prepared_model, smollm2_vllm

    from overnight.testing.implicit_trial import TrialSize, run_hindsight_trial, run_trial

    say = clock()
    model = prepared_model(say)
    size = TrialSize(args.conversations, args.turns, args.samples, args.seed)
    with (
        tempfile.TemporaryDirectory(prefix="implicit-nights-") as work,
        smollm2_vllm(model, Path(work), say) as url,
    ):
        if args.hindsight:  # the base model's reference answers cached in .cache/
            arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
            run_hindsight_trial(url, model, Path(work), size, say, CACHE, arms)
        else:
            run_trial(url, model, Path(work), size, say=say)


if __name__ == "__main__":
    main()
