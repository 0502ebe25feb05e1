"""The window's logged responses as training data, labelled at prefill speed (`distill.prefill`).

A train prompt's conversation in the log store carries the response production gave and, in OpenAI
logs, the model name that served it (`conversations.target_version`). Two kinds are used:

- **own**: served under a name of the current target version (`generation.logged.served_names`, and the
  names `specdistill target register --served-name` recorded, from that registration on: a response
  logged under the name before it is an older version's). It *is* the target's answer: one prefill
  labels it and it stands in for a regenerated answer (same id). Not trusted blindly: it must read as
  text the target writes at the temperature its request asked for (`own_text_check`: a greedy request's
  tokens are the target's greedy choices, a sampled one's as likely as its own samples at that
  temperature). One that does not is refused, counted by reason, neither trained
  on nor put in the suffix corpus, and the prompt is answered again.
- **other**: written by another model (ShareGPT's ChatGPT answers, an older target version), labelled the
  same way when `generation.logged.other` is on: off-policy text with an on-policy teacher, as an extra
  example (`<id>~log`) beside the prompt's regenerated answer. Never in the suffix corpus: not the target's text.

A response that is empty, cut mid-character, carries chat-template control tokens or does not fit the
target's context is skipped with its reason counted; nothing else is lost.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

from specdistill import paths
from specdistill.budget import Deadline
from specdistill.data.logstore import LogStore
from specdistill.data.prompts import Prompt, encode_chat
from specdistill.distill.examples import Example, encode_conversation
from specdistill.distill.features import FeatureCache
from specdistill.distill.prefill import TOP_K, Labelled, label_by_prefill
from specdistill.distill.teacher import TeacherCache
from specdistill.modeling.models import LoadedModel
from specdistill.ops.targets import Period, absolute_ref, held_at, served_name_periods, target_history
from specdistill.pipeline.outputs import LoggedData
from specdistill.pipeline.stages.answers.answer_file import append_records
from specdistill.recipe import ConfigError

OTHER_SUFFIX = "~log"  # the id of another model's labelled response: `<conversation id>~log`


def own_names(served_names: dict[str, str], target_ref: str, fingerprint: str) -> dict[str, list[Period]]:
    """The served model names of this target version and when each was its own (`ops.targets.served_name_periods`):
    the config's mapping (each name to a target: its reference, directory or fingerprint), plus the names its
    registrations recorded, from each registration on. A name mapped to a target that is neither this run's
    nor a registered version is a config error naming the key."""
    history = target_history()
    known = {fingerprint: fingerprint, target_ref: fingerprint, absolute_ref(target_ref): fingerprint}
    for v in history:
        known.update({v.fingerprint: v.fingerprint, v.ref: v.fingerprint, v.path: v.fingerprint})
    mapped = set()
    for name, ref in served_names.items():
        if ref not in known and absolute_ref(ref) not in known:
            raise ConfigError(f"generation.logged.served_names.{name}: {ref!r} is not a registered target nor this "
                              f"run's target ({target_ref!r}); `specdistill target register {ref} --served-name {name}` "
                              "records it")
        if known.get(ref, known.get(absolute_ref(ref))) == fingerprint:
            mapped.add(name)
    return served_name_periods(fingerprint, mapped)


# what the target's own text is held to (`own_text_check`; measured in benchmarks/experiments/own_text.py)
GREEDY_MIN = 0.9  # a greedy request: share of tokens at (or within NEAR_TIE of) the target's top choice
Z_MIN = -3.0  # a sampled request: the sampled z at the request's temperature (its own samples: about N(0, 1))
TOP_K_MIN = 0.5  # a sampled request: share of tokens among the target's TOP_K (its samples at T=1: p5 0.64; noise 0.23)


NOT_GREEDY = "a greedy request whose tokens are not the target's greedy choice"
NOT_TOP_K = f"tokens outside the target's {TOP_K} most likely"
UNLIKELY = "less likely than the target's own samples at the request's temperature"


def own_text_check(stats: Labelled, temperature: float | None) -> str | None:
    """Why a response claimed by the target is not text it writes at the request's `temperature`, or None
    when it is. 0: a greedy request, held to the target's greedy choices (near-ties allowed: another
    engine or dtype served it); else held to the likelihood of the target's own samples at that
    temperature (`sampled_z`, which must have been taken there; None: as at temperature 1, the most the
    target's own samples are allowed) and to a share of its top-k that its own samples reach. Measured
    on the demo target in benchmarks/experiments/own_text.py (docs/data.md)."""
    if temperature is not None and temperature <= 0:
        return NOT_GREEDY if stats.near_greedy_share < GREEDY_MIN else None
    if stats.top_k_share < TOP_K_MIN:
        return NOT_TOP_K
    return UNLIKELY if stats.sampled_z < Z_MIN else None


def check_response(tokenizer, prompt: list[dict], text: str | None, context: int, max_tokens: int
                   ) -> tuple[Example | None, str | None]:
    """The prompt and response as an example (response cut to `max_tokens`), or the reason to skip it."""
    if text is None or not text.strip():
        return None, "empty"
    if "\ufffd" in text:
        return None, "cut mid-character"
    if any(tok and tok in text for tok in tokenizer.all_special_tokens):
        return None, "control tokens"
    try:
        full = encode_conversation(tokenizer, prompt + [{"role": "assistant", "content": text}])
    except ValueError:
        return None, "does not render"
    head = encode_chat(tokenizer, prompt)
    if len(full.input_ids) > context:
        return None, "over the context"
    response = full.input_ids[len(head):][:max_tokens]
    return Example("", head + response, [False] * len(head) + [True] * len(response)), None


def label_logged(config, target: LoadedModel, prompts: list[Prompt], out_path: Path, teacher: TeacherCache,
                 features: FeatureCache | None, deadline: Deadline, done: dict[str, dict]) -> LoggedData:
    """Label the prompts' logged responses into the answers file and its caches (resumable: a response
    recorded there is not labelled again). Own answers then stand as `done` answers of their prompts."""
    settings = config.generation.logged
    result = LoggedData()
    if not (settings.own or settings.other):
        return result
    names = own_names(settings.served_names, config.target, target.fingerprint)
    with LogStore(config.log_db) as store:
        conversations = {str(c.id): c for c in store.by_ids([int(p.id) for p in prompts])}
    context = int(getattr(target.model.config, "max_position_embeddings", None) or 1 << 30)
    skipped: Counter = Counter()
    own, other = [], []
    temperatures: dict[str, float | None] = {}  # what each logged request asked for (None: not logged)
    for p in prompts:
        conv, n = conversations[str(p.id)], len(p.messages)
        text = conv.messages[n].content if len(conv.messages) > n and conv.messages[n].role == "assistant" else None
        if text is None:
            continue  # a prompt without a logged answer: answered as always
        is_own = conv.target_version in names and held_at(names[conv.target_version], conv.arrived_at)
        if not (settings.own if is_own else settings.other):
            continue
        example, reason = check_response(target.tokenizer, p.messages, text, context, settings.max_tokens)
        if reason is not None:
            skipped[reason] += 1
            continue
        example.id = p.id if is_own else f"{p.id}{OTHER_SUFFIX}"
        (own if is_own else other).append((p, example))
        # what the request asked for; not logged: what production samples at (`generation.logged.temperature`)
        temperatures[example.id] = conv.request_temperature if conv.request_temperature is not None else settings.temperature
    result.skipped = dict(skipped)
    todo = [(p, ex) for p, ex in own + other if ex.id not in done]
    started = time.time()
    labelled: dict[str, Labelled] = {}
    if todo:  # each response's sampled z at its request's temperature (1 when greedy or not logged)
        labelled = label_by_prefill(target.model, [ex for _, ex in todo], teacher, features,
                                    tokens_per_batch=settings.tokens_per_batch, deadline=deadline,
                                    temperatures={i: t if t else 1.0 for i, t in temperatures.items()},
                                    special_ids=target.tokenizer.all_special_ids)
    records, refused = [], Counter()
    for p, ex in todo:
        stats = labelled.get(ex.id)
        if stats is None:
            result.not_labelled += 1
            continue
        is_own = ex.id == p.id
        why = own_text_check(stats, temperatures[ex.id]) if is_own else None
        if why is not None:  # not taken as the target's own, nor trained on: the prompt is answered again
            refused[why] += 1
            continue
        head = sum(1 for m in ex.assistant_mask if not m)
        records.append({"id": ex.id, "prompt": p.messages, "prompt_ids": ex.input_ids[:head], "response_ids": ex.input_ids[head:],
                        "response": target.tokenizer.decode(ex.input_ids[head:], skip_special_tokens=True),
                        "finish": "logged", "temperature": temperatures[ex.id], "source": "own" if is_own else "other",
                        "mean_logprob": round(stats.mean_logprob, 4), "greedy_share": round(stats.greedy_share, 4),
                        "sampled_z": round(stats.sampled_z, 2)})
    result.refused, result.refused_why = sum(refused.values()), dict(refused)
    with paths.open_private(out_path, "a", encoding="utf-8") as out:
        append_records(out, records, done)
    for rec in done.values():
        if rec.get("source") == "own":
            result.own, result.own_tokens = result.own + 1, result.own_tokens + len(rec["response_ids"])
        elif rec.get("source") == "other":
            result.other, result.other_tokens = result.other + 1, result.other_tokens + len(rec["response_ids"])
    result.minutes = (time.time() - started) / 60
    if result.refused:
        print(f"logged answers: {result.refused} claimed by this target are not its text and are answered again "
              f"({refused_line(result.refused_why)})", file=sys.stderr)
    return result


def refused_line(why: dict[str, int]) -> str:
    return "; ".join(f"{n} {reason}" for reason, n in sorted(why.items(), key=lambda kv: -kv[1]))

