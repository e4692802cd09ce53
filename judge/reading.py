"""The user's next message read without a model: what it says of the answer before it.

Three readers, each measured alone and together on a labelled corpus of reactions
phrased the way people write them (tests/data/reactions.jsonl; bench/reactions.py
prints each one's confusion matrix, docs/signals.md the numbers):

- **the rules**: a reaction at the start of the message ("thanks", "no, ..."), precise
  where they fire, blind to everything else (5 of 20 praises, 7 of 20 complaints on
  the issue's held-out set), and fooled by politeness and sarcasm ("thanks, but ...",
  "great, wrong again");
- **cues**: a lexicon of complaint and correction written for what the rules miss,
  anywhere in the message (negation, "but", "still", "wrong", "you forgot", doubt,
  "not X, Y", eye-rolling emoji, a few words of other languages), and a smaller one of
  acknowledgement ("ok", "got it", "merci", a thumbs-up);
- **vader** (vaderSentiment's lexicon): ranks praise above complaint well, but reads
  "please" as friendly and many plain complaints as neutral, so it speaks last and
  only past thresholds chosen on the corpus's dev split.

`read` combines them: a complaint the rules are sure of; then any complaint cue, which
overrides the rules' acceptance (the politeness and sarcasm above); then the rules'
acceptance; then acknowledgement cues; then vader past its thresholds; else nothing
(`None`): a message nobody read says nothing, and never counts as approval. vader is
an optional dependency (the `train` extra): without it, the rest reads as before and
says so in the reading's rule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

# A reaction at the start of the next user message. Anchored at the start on purpose:
# "no" inside a sentence ("no more than 3 items") says nothing about the last answer.
ACCEPT_RULE = re.compile(
    r"^\W*(thanks?\b|thank you|thx|ty\b|perfect|great|awesome|excellent|nice\b|cool\b|"
    r"(that|this|it) (works|worked|did it|helps|helped)|works\b|worked\b|correct\b|exactly\b|"
    r"yes,? (that'?s|this is) (it|right|correct)|got it|looks good|lgtm)",
    re.IGNORECASE,
)
CORRECT_RULE = re.compile(
    r"^\W*(no\b(?!\s+(worries|problem|prob)\b)|nope\b|wrong\b|incorrect\b|"
    r"not (quite|right|correct|what)\b|"
    r"(that|this|it)('?s| is| was) (not|wrong|incorrect)\b|"
    r"(that|this|it) (didn'?t|doesn'?t|does not|did not) work|"
    r"you (misunderstood|misread|got it wrong|are wrong|'re wrong)|"
    r"i (said|asked|meant|wanted|told you)\b|try again\b|still (wrong|not|broken)\b|"
    r"actually,? (i|it|that)\b|that'?s not what)",
    re.IGNORECASE,
)

# Complaint and correction anywhere in the message: what the rules miss, and what makes
# their acceptance a politeness ("thanks, but it still crashes") or sarcasm ("great,
# you broke it"). Written for people's phrasings, chosen on the dev split only.
_COMPLAINT_CUES = [
    # negation of the answer: "not X", "isn't", "doesn't work"; not "not bad", "no worries"
    r"\bnot\b(?!\s+(bad|only|a problem)\b)",
    r"\b(do|does|did|is|was|are|were|would|could|should|has|have|wo|ai|ca)n'?t\b"
    r"(?!\s+(know|complain|wait|be happier|thank you enough)\b)",
    r"\bno\b(?!\s+(worries|problem|prob|more than|need|rush)\b)",
    # "thanks, but ...", except a request's "the same, but in Rust"
    r"(?<!same )(?<!same thing )(?<!same thing, )(?<!same, )\b(but|however|though|although)\b",
    r"\bstill\b",
    r"\b(wrong|incorrect|inaccurate|mistaken?|mistakes?|false|bogus|off by|way off)\b",
    r"\b(exception|traceback|\w+error|404)\b",
    r"\b(broken|broke|break\w*|crash\w*|fails?|failed|failing|worse|garbage|useless|nonsense|"
    r"rubbish|ridiculous|pointless|nowhere|frustrat\w*|annoy\w*|confus\w*|contradict\w*|"
    r"outdated|deprecated|made[- ]up|making (things|stuff) up|hallucinat\w*|dead|missing|"
    r"typo|misspel\w*|spelled|mixed up|messed up|ignored?|ignoring|nothing works|"
    r"(no|zero) sense|doesnt|dont|isnt|didnt|backwards|reversed|swapped|bad advice|terrible|"
    r"awful|too (long|short|vague|complicated|verbose|much)|completely different|"
    r"different (result|answer|number))\b",
    # doubt: "are you sure?", "really?", "hmm", "I think you meant", "double-check"
    r"\b(are|r) (you|u) (sure|certain)\b|\breally\s*\?|^\W*h+m+\b|\bpretty sure\b|"
    r"\bi think you\b|\b(double|re)[- ]?check\b|\bwhere did you get\b|\bwhy (would|did|do) "
    r"you\b|\bwhy is (it|this|that) (so|still)\b|\bnot convinced\b|\bi doubt\b|\?\s*\?|"
    r"\bkidding\b|\b(did|are|do) you even\b|\bis (that|this|it) (right|correct|true)\s*\?|"
    r"\bi thought (it|that|you)\b",
    # the user repeats themself, or says what it should have been
    r"\b(third time|second time|same (answer|error|problem|mistake|result)|"
    r"i (said|asked|told you|wrote)|i'?ve (asked|said|told)|you (wrote|said|counted|used|"
    r"confused|mixed))\b|(?<!what )\bi (needed|wanted)\b",
    r"\b(should be|should have|needs to be|i meant|you meant|supposed to|rather than|instead of|"
    r"the opposite(?! of)|the correct|correct (answer|spelling|one) is|careful|oops|"
    r"you forgot|forgot to|you (deleted|broke|removed|changed|missed|keep|never|didn'?t))\b",
    # frustration, and sarcasm's stock phrases
    r"\b(ugh|wtf|smh|ffs|come on|nice try|yeah,? right|thanks for nothing|no thanks|"
    r"so helpful\. not|expected better|i'?m done|please (stop|just|read|actually|answer|try)|"
    r"stop \w+ing)\b",
    r"^\W*((yeah|oh),? )?sure[.,!]*\s+and (i'?m|the|you'?re|pigs)\b",
    r"[🙄😒🙃😡😠🤦👎😤]",
    # other languages: French, German, Spanish, Portuguese, Italian
    r"\b(faux|ne (marche|fonctionne) pas|pas (ça|correct|bon)|stimmt nicht|falsch|nicht\b|"
    r"no es|no funciona|no me sirve|incorrect[oa]|errad[oa]|sbagliat[oa]|non (funziona|è))",
]
COMPLAINT_CUES = re.compile("|".join(f"(?:{c})" for c in _COMPLAINT_CUES), re.IGNORECASE)
# Weaker: a complaint where nothing praises the answer, sarcasm beside praise ("great,
# another error. just what I needed": two of them), sincere once beside it ("you're the
# best, seriously"; "great, now the error case").
_WEAK_CUES = [
    r"\b(errors?|bugs?)\b(?!\s+(handling|case|message|code|cases))",
    r"\b(again|same thing|seriously|just what i (needed|wanted)|gee|meh|nah)\b",
    r"^\W*oh,? (great|wonderful|perfect|brilliant)\b",
]
WEAK_CUES = re.compile("|".join(f"(?:{c})" for c in _WEAK_CUES), re.IGNORECASE)

# Praise in words that complaint cues would misread ("no complaints", "that's what I
# meant"): read before them.
PRAISE_IDIOMS = re.compile(
    r"^\W*((yes|yep|exactly),? )?(that'?s|this is|exactly) what i (meant|wanted|asked for|needed)"
    r"\b|\b(can'?t complain|couldn'?t be happier|no complaints|not bad)\b",
    re.IGNORECASE,
)
# Acknowledgement the rules do not know: "ok, and ...", "got it", "makes sense", thanks
# in other languages, a thumbs-up. Read only where no complaint cue is.
_ACK_CUES = [
    PRAISE_IDIOMS.pattern,
    r"\b(?!think)th\w{1,3}k\s*(s|you|u)\b",
    r"^\W*(ok(ay|ie|ey)?|k+|alright|all right|sure|right|understood|noted|fair enough|yep|yup|"
    r"yes|yeah|good|fine|cool|makes sense|sounds (good|right|great)|seems (fine|right|good)|"
    r"got it|gotcha|roger|i see|will do|d'accord|vale|bien|gut)\b",
    r"\b(thanks?|thank (you|u)|thankyou|thx|thnx|thnks|ty|tysm|ta|cheers|appreciated?|"
    r"merci|gracias|danke|obrigad[oa]|grazie|legend|lifesaver|spot on|you rock|gr8|"
    r"nailed it|perfect[oa]?|parfait|well done|good job|exactly right|that'?s right|"
    r"owe you|saved me)\b",
    r"ありがとう|助かり|谢谢|감사",
    r"[👍👌🙏🎉🎊🙌❤😊🙂😍👏🏅💯]",
    r"\b10/10\b",
]
ACK_CUES = re.compile("|".join(f"(?:{c})" for c in _ACK_CUES), re.IGNORECASE)
# A message that opens as a new request carries no reaction: vader would read its topic
# ("the best way to learn", "Moby Dick"), not the user's mood.
NEW_REQUEST = re.compile(
    r"^\W*(how|what|what'?s|why|where|when|who|which|is there|are there|can you|could you|"
    r"would you|will you|please|write|give|make|explain|summari[sz]e|translate|list|tell|draft|"
    r"plan|suggest|show|create|generate|describe|convert|help|find|recommend|next|now|and)\b",
    re.IGNORECASE,
)

# vader's compound score past which it reads approval or a complaint (chosen on the dev
# split: bench/reactions.py --tune); between them it says nothing.
VADER_APPROVAL = 0.45
VADER_COMPLAINT = -0.25


@dataclass(frozen=True)
class Reading:
    """What a message says of the answer before it: +1 approval, -1 a complaint."""

    value: float
    confidence: float
    reader: str  # "rules", "cues", "vader"
    rule: str  # what it found, in words (a signal's `rule`: the same for the same reader)
    detail: dict  # the cue it matched, or vader's score


def rules(text: str) -> int | None:
    """The rules alone: -1 a correction at the start, +1 thanks at the start, else None."""
    if CORRECT_RULE.search(text):
        return -1
    if ACCEPT_RULE.search(text):
        return 1
    return None


def cues(text: str) -> tuple[int, str] | None:
    """The cue lexicons alone: (-1, the cue) for a complaint, (+1, the cue) for an
    acknowledgement, else None."""
    found = _complaint(text, praised=False)
    if found:
        return -1, found
    found = ACK_CUES.search(text)
    if found:
        return 1, found.group(0).strip()
    return None


def _complaint(text: str, praised: bool) -> str | None:
    """The complaint cue a message holds, if any: a strong one anywhere, a weak one where
    nothing `praised` it, or two weak ones."""
    if PRAISE_IDIOMS.search(text):
        return None
    found = COMPLAINT_CUES.search(text)
    if found:
        return " ".join(found.group(0).split())
    weak = [" ".join(m.group(0).split()) for m in WEAK_CUES.finditer(text)]
    if weak and (not praised or len(weak) >= 2):
        return ", ".join(weak)
    return None


@cache
def _analyzer():
    try:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    except ImportError:  # the `train` extra is not installed: the rest still reads
        return None
    return SentimentIntensityAnalyzer()


def vader(text: str) -> float | None:
    """vaderSentiment's compound score in [-1, 1]; None where it is not installed."""
    analyzer = _analyzer()
    return None if analyzer is None else analyzer.polarity_scores(text)["compound"]


def read(text: str) -> Reading | None:
    """The readers combined (the module's docstring says in which order, and why); None
    where none of them is sure: the message says nothing."""
    said = rules(text)
    if said == -1:
        return Reading(-1.0, 0.8, "rules", "the next message corrects it", {})
    ack = ACK_CUES.search(text)
    score = None if NEW_REQUEST.search(text) else vader(text)
    praised = said == 1 or ack is not None or (score or 0) >= VADER_APPROVAL
    complaint = _complaint(text, praised)
    if complaint:
        return Reading(
            -1.0, 0.7, "cues", "the next message complains or corrects", {"cue": complaint}
        )
    if said == 1:
        return Reading(1.0, 0.8, "rules", "the next message accepts it", {})
    if ack:
        cue = {"cue": " ".join(ack.group(0).split())}
        return Reading(1.0, 0.6, "cues", "the next message acknowledges it", cue)
    if score is not None and score >= VADER_APPROVAL:
        return Reading(1.0, 0.5, "vader", "the next message reads as approval", {"vader": score})
    if score is not None and score <= VADER_COMPLAINT:
        return Reading(
            -1.0, 0.5, "vader", "the next message reads as a complaint", {"vader": score}
        )
    return None
