"""Training questions and benchmarks: reading, validation, labeled/unlabeled split, prompts, batch order.

Two input layouts:
- parquet in the verl layout (the paper's public code, `data/benchmarks/`, `trapo.commands.prepare`):
  `prompt` (list of chat messages; the last user turn is the question, unless
  `extra_info.question` holds it bare),
  `reward_model.ground_truth`, optional `extra_info.labeled` and `extra_info.index`;
- JSONL with `question`, `answer`, optional `labeled` and `id`.

Everything is checked before any model loads; an error names the file, the
row and the field. An unlabeled question may keep its gold answer: the
trainer uses it for diagnostics only (pseudo-label precision), never for reward.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from trapo import resources

# The paper's system prompt for Qwen-family models (appendix "System Prompt").
THINK_SYSTEM = (
    "Your task is to follow a systematic, thorough reasoning process before providing the final solution. "
    "This involves analyzing, summarizing, exploring, reassessing, and refining your thought process through "
    "multiple iterations. Structure your response into two sections: Thought and Solution. In the Thought "
    'section, present your reasoning using the format: "<think>\\n {thoughts} </think>\\n". Each thought should '
    'include detailed analysis, brainstorming, verification, and refinement of ideas. After "</think>\\n," in '
    "the Solution section, provide the final, logical, and accurate answer, clearly derived from the exploration "
    "in the Thought section. If applicable, include the answer in \\boxed{} for closed-form results like "
    "multiple choices or mathematical solutions."
)
# The simplified chain-of-thought prompt the paper uses for Llama-3.1-8B (after Simple-RL-Zoo).
COT_SUFFIX = "\nLet's think step by step and output the final answer within \\boxed{}."


class DataError(ValueError):
    pass


# The evaluation sets shipped with the project (data/benchmarks/README.md; installed, inside the package:
# trapo/resources.py); `TRAPO_BENCHMARKS` points elsewhere. Evaluation, decontamination
# (trapo.commands.prepare), tests and benches all read this.
REPO_BENCHMARKS = resources.shipped("benchmarks")


def benchmarks_dir() -> Path:
    return Path(os.environ.get("TRAPO_BENCHMARKS") or REPO_BENCHMARKS)


@dataclass(frozen=True)
class Question:
    uid: str  # unique across all training files
    question: str
    answer: str | None  # gold; for an unlabeled question: diagnostics only
    labeled: bool
    messages: tuple[tuple[str, str], ...] | None  # (role, content) as stored in a parquet `prompt`
    where: str  # "file row N", for error messages


def _text(value, where: str, field: str, required: bool) -> str | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        if required:
            raise DataError(f"{where}: field '{field}' is missing")
        return None
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise DataError(f"{where}: field '{field}' must be a string, got {type(value).__name__}")
    text = valid_unicode(str(value), where, field)
    if required and not text.strip():
        raise DataError(f"{where}: field '{field}' is empty")
    return text


def valid_unicode(text: str, where: str, field: str) -> str:
    """`text`, when it is valid Unicode: a lone surrogate (JSON's "\\ud800") cannot be encoded, so the
    tokenizer would fail on it mid-run."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise DataError(
            f"{where}: field '{field}' holds invalid Unicode (a lone surrogate {text[err.start]!r} at character "
            f"{err.start}); fix or remove the row"
        ) from None
    return text


# Three or more words in a row, separated by spaces alone: a sentence ("see the solution above"), not a
# mathematical answer (a set "red, green, blue", "\\text{Monday}", "x = 2").
_PROSE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}(?: +[A-Za-z]{2,}){2,}")


def gold_problem(gold: str | None, math: bool = True) -> str | None:
    """Why a labeled row's gold cannot be graded ('empty', 'prose'), or None. Such a gold scores 0 against
    every response, so its question teaches nothing but noise. math=False (a task verifier grades it,
    `reward.verifier`): only an empty gold is one."""
    if gold is None or not gold.strip():
        return "empty"
    return "prose" if math and _PROSE.search(re.sub(r"\\[A-Za-z]+", " ", gold)) else None


def _flag(value, where: str, field: str) -> bool | None:
    if value is None:
        return None
    if not isinstance(value, bool):
        raise DataError(f"{where}: field '{field}' must be true or false, got {value!r}")
    return value


def parquet_rows(path: Path) -> list[Question]:
    try:
        table = pq.read_table(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises many types; all mean "not a readable parquet"
        raise DataError(f"{path}: cannot read as parquet ({err})") from None
    try:
        rows = table.to_pylist()
    except UnicodeDecodeError:  # a string column whose bytes are not UTF-8: pyarrow names only a byte offset
        raise parquet_not_utf8(path, table) from None
    out = []
    for i, row in enumerate(rows):
        where = f"{path} row {i}"
        prompt = row.get("prompt")
        if not isinstance(prompt, list) or not prompt:
            raise DataError(f"{where}: field 'prompt' must be a non-empty list of chat messages")
        messages = []
        for j, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DataError(f"{where}: field 'prompt[{j}]' must have string 'role' and 'content'")
            messages.append((m["role"], valid_unicode(m["content"], where, f"prompt[{j}].content")))
        users = [c for r, c in messages if r == "user"]
        if not users:
            raise DataError(f"{where}: field 'prompt' has no user message (the question)")
        extra = row.get("extra_info") or {}
        if not isinstance(extra, dict):
            raise DataError(f"{where}: field 'extra_info' must be a struct")
        # A file written by trapo.commands.prepare keeps the bare question beside its templated prompt,
        # so a config's prompt_template renders it once, not around the stored wrapper.
        if extra.get("question") is not None:
            question = _text(extra["question"], where, "extra_info.question", required=True)
        else:
            question = _text(users[-1], where, "prompt[user].content", required=True)
        reward = row.get("reward_model") or {}
        if not isinstance(reward, dict):
            raise DataError(f"{where}: field 'reward_model' must be a struct with 'ground_truth'")
        answer = _text(reward.get("ground_truth"), where, "reward_model.ground_truth", required=False)
        labeled = _flag(extra.get("labeled"), where, "extra_info.labeled")
        index = extra.get("index", i)
        source = row.get("data_source")
        uid = f"{path.name}:{source + '/' if isinstance(source, str) else ''}"
        uid += _text(index, where, "extra_info.index", required=True)
        labeled = answer is not None if labeled is None else labeled
        out.append(Question(uid, question, answer, labeled, tuple(messages), where))
    return out


def not_utf8(path: Path, n: int, line: bytes, at: int) -> DataError:
    """The error for a byte that is not UTF-8 at index `at` of line `n` (its bytes, `line`) of `path`."""
    return DataError(
        f"{path} line {n}: not UTF-8 text (byte {line[at]:#04x} at column {at + 1}); "
        "re-encode the file as UTF-8 or remove the row"
    )


def parquet_not_utf8(path: Path, table) -> DataError:
    """The first value of `table` (read from `path`) that is not UTF-8, named by row and field."""
    for name in table.column_names:
        column = table.column(name)
        for i in range(len(column)):
            try:
                column[i].as_py()
            except UnicodeDecodeError as err:
                return DataError(
                    f"{path} row {i}: field '{name}' is not UTF-8 text (byte {err.object[err.start]:#04x} at "
                    f"byte {err.start + 1} of its text); re-encode the file's text as UTF-8 or remove the row"
                )
    return DataError(f"{path}: cannot read as parquet (text that is not UTF-8)")


def jsonl_rows(path: Path) -> list[Question]:
    out = []
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise DataError(f"{path}: cannot read it ({err.strerror})") from None
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError as err:
        start = raw.rfind(b"\n", 0, err.start) + 1  # the bad byte's line, named as its rows are
        raise not_utf8(path, raw.count(b"\n", 0, err.start) + 1, raw[start:], err.start - start) from None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{path} line {i + 1}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object with 'question' and 'answer'")
        question = _text(row.get("question"), where, "question", required=True)
        answer = _text(row.get("answer"), where, "answer", required=False)
        labeled = _flag(row.get("labeled"), where, "labeled")
        uid = f"{path.name}:{_text(row.get('id', i + 1), where, 'id', required=True)}"
        out.append(Question(uid, question, answer, answer is not None if labeled is None else labeled, None, where))
    return out


def load_questions(files: list[str], labeled_ratio: float | None = None, seed: int = 0) -> list[Question]:
    """Read and check every training file; split labeled/unlabeled.

    With `labeled_ratio` None each row's flag decides (a row without one is
    labeled when it has an answer); otherwise round(ratio * rows) rows that
    have a gradable answer (`gold_problem`) are drawn as labeled with `seed`,
    the rest are unlabeled.
    """
    questions: list[Question] = []
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise DataError(f"{path}: training file not found")
        if path.suffix == ".parquet":
            questions += parquet_rows(path)
        elif path.suffix in (".jsonl", ".json"):
            questions += jsonl_rows(path)
        else:
            raise DataError(f"{path}: unknown format (expected .parquet or .jsonl)")
    if not questions:
        raise DataError(f"{', '.join(files)}: no questions")
    seen: dict[str, str] = {}
    for q in questions:
        if q.uid in seen:
            raise DataError(f"{q.where}: duplicate id '{q.uid.split(':', 1)[1]}' (first at {seen[q.uid]})")
        seen[q.uid] = q.where
    if labeled_ratio is not None:
        with_gold = [i for i, q in enumerate(questions) if gold_problem(q.answer) is None]
        k = round(labeled_ratio * len(questions))
        if k > len(with_gold):
            raise DataError(f"labeled_ratio {labeled_ratio}: needs {k} rows with an answer, found {len(with_gold)}")
        chosen = set(random.Random(seed).sample(with_gold, k))
        questions = [
            Question(q.uid, q.question, q.answer, i in chosen, q.messages, q.where) for i, q in enumerate(questions)
        ]
    for q in questions:
        if q.labeled and q.answer is None:
            raise DataError(f"{q.where}: a labeled row needs an answer (field 'answer' / 'reward_model.ground_truth')")
    return questions


def gradable(questions: list[Question], drop: bool, math: bool = True) -> tuple[list[Question], int]:
    """(the questions, how many were dropped): a labeled question whose gold cannot be graded is a DataError
    naming its row and why, or with `drop` (data.drop_ungradable_golds) left out and counted. math: as
    `gold_problem`'s."""
    bad = [(q, why) for q in questions if q.labeled and (why := gold_problem(q.answer, math))]
    if bad and not drop:
        q, why = bad[0]
        raise DataError(
            f"{q.where}: a labeled row's gold is {why} ({q.answer!r}): it would score 0 against every response "
            f"({len(bad)} such rows in all); fix the gold, or set data.drop_ungradable_golds=true to drop them"
        )
    dropped = {id(q) for q, _ in bad}
    return [q for q in questions if id(q) not in dropped], len(bad)


def select_for_mode(questions: list[Question], mode: str) -> list[Question]:
    """supervised: labeled only; unsupervised: every question, labels hidden; else as is."""
    if mode == "supervised":
        out = [q for q in questions if q.labeled]
        if not out:
            raise DataError("mode 'supervised' needs labeled questions; the training files have none")
        return out
    if mode == "unsupervised":
        return [Question(q.uid, q.question, q.answer, False, q.messages, q.where) for q in questions]
    if mode == "trapo" and not any(q.labeled for q in questions):
        raise DataError("mode 'trapo' needs some labeled questions (they form the reliable database)")
    if mode in ("trapo", "naive_semi") and all(q.labeled for q in questions):
        raise DataError(
            f"mode '{mode}' needs unlabeled questions, and every training row is labeled: mark some "
            "unlabeled (a 'labeled' flag, or data.labeled_ratio), or use mode supervised"
        )
    return questions


def template_messages(question: str, template: str) -> list[tuple[str, str]]:
    """The chat messages of one question under a template (think, cot; anything else: the question alone)."""
    if template == "think":
        return [("system", THINK_SYSTEM), ("user", f"This is the problem: {question}")]
    if template == "cot":
        return [("user", question + COT_SUFFIX)]
    return [("user", question)]


def render_prompt(q: Question, template: str, tokenizer) -> str:
    """The prompt text for one question.

    think: the paper's system prompt, "This is the problem: {q}", and the
    assistant turn opened with "<think>"; cot: the question plus the simple
    chain-of-thought instruction; chat: the question as the only user turn;
    dataset: the parquet's stored messages; plain: the question text as is.
    Chat templates come from the tokenizer; without one, a plain
    "System:/User:/Assistant:" layout is used.
    """
    if template == "plain":
        return q.question
    messages = (
        list(q.messages)
        if template == "dataset" and q.messages is not None
        else template_messages(q.question, template)
    )
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages], tokenize=False, add_generation_prompt=True
        )
    else:
        text = "".join(f"{r.capitalize()}: {c}\n" for r, c in messages) + "Assistant:"
    return text + ("<think>\n" if template == "think" else "")


def stop_token_ids(tokenizer, generation_eos: int | list[int] | None = None) -> list[int]:
    """Token ids that end a response: EOS, the generation config's EOS ids, and the chat template's
    end-of-turn token (e.g. Qwen's <|im_end|>, which is not its tokenizer's EOS).

    The end-of-turn token is found by rendering a dummy assistant turn and taking
    the first special token after its text. Without it, a model that closes its
    turn would go on writing, and a later \\boxed{} would be the one graded.
    """
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids += [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
    if getattr(tokenizer, "chat_template", None):
        mark = "\u2063answer\u2063"  # text no template adds on its own
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": mark}], tokenize=False
        )
        after = text.split(mark, 1)[-1]
        special = set(tokenizer.all_special_ids) | {
            i for i, tok in tokenizer.added_tokens_decoder.items() if getattr(tok, "special", False)
        }
        tail = tokenizer(after, add_special_tokens=False)["input_ids"]
        ids += [i for i in tail if i in special][:1]
    return list(dict.fromkeys(ids))  # unique, in order


def prompt_ids(q: Question, template: str, tokenizer) -> list[int]:
    """The prompt's token ids as the rollout engine receives them (a chat template adds its own specials)."""
    text = render_prompt(q, template, tokenizer)
    return tokenizer(text, add_special_tokens=not getattr(tokenizer, "chat_template", None))["input_ids"]


def tokenize_prompts(
    questions: list[Question], template: str, tokenizer, max_tokens: int | None, key: str = "data.max_prompt_tokens"
) -> list[list[int]]:
    """Token ids per question; a prompt over `max_tokens` (None: no cap) is an input error naming the setting
    `key`, not a silent cut."""
    out = []
    for q in questions:
        ids = prompt_ids(q, template, tokenizer)
        if max_tokens is not None and len(ids) > max_tokens:
            raise DataError(f"{q.where}: prompt has {len(ids)} tokens, over {key}={max_tokens}")
        if not ids:
            raise DataError(f"{q.where}: prompt tokenizes to nothing")
        out.append(ids)
    return out


def epoch_batches(
    num_questions: int, batch_size: int, multiple: int, seed: int, epoch: int, admitted: list[bool] | None = None
) -> list[list[int]]:
    """The question indices of each step of one epoch.

    A fixed permutation per (seed, epoch), cut into batches of `batch_size`;
    the last batch keeps what is left rounded down to a multiple of `multiple`.
    The trainer passes train.update_batch_size, a multiple of every world size
    the batch settings allow: each rank gets the same number of questions, and
    the order does not depend on the world size, so a run may resume on another
    number of ranks. Questions left out of an epoch keep their previous pass
    rate (see PassRateTracker). `admitted` [num_questions] (sampling.curriculum):
    the same permutation with the other questions taken out, except the first
    of them in it that top the last batch up to `batch_size`: the epoch's
    batches are fewer and full, and no admitted question is dropped that
    would not be dropped without a curriculum. None: every question.
    """
    order = list(range(num_questions))
    random.Random(f"{seed}-{epoch}").shuffle(order)
    if admitted is not None:
        short = -sum(map(bool, admitted)) % batch_size  # questions the last batch lacks
        fill = set([q for q in order if not admitted[q]][:short])
        order = [q for q in order if admitted[q] or q in fill]
    batches = []
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        chunk = chunk[: len(chunk) - len(chunk) % multiple]
        if chunk:
            batches.append(chunk)
    return batches


# ----------------------------------------------------------------------------- benchmarks
# A benchmark file is any verl-layout parquet (`prompt`, `reward_model.ground_truth`, `data_source`) or
# JSONL (`question`, `answer`); read by evaluation, validation during training and the held-out test.


@dataclass
class Benchmark:
    name: str
    questions: list[Question]  # one per distinct prompt
    source: str  # file


def _prompt_key(q: Question) -> str:
    text = json.dumps(q.messages) if q.messages is not None else q.question
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _group(name: str, rows: list[Question], source: str) -> Benchmark:
    """One question per distinct prompt; a repeated prompt must repeat its answer too."""
    seen: dict[str, Question] = {}
    for q in rows:
        key = _prompt_key(q)
        if key in seen:
            if seen[key].answer != q.answer:
                raise DataError(f"{q.where}: repeats the prompt of {seen[key].where} with a different answer")
            continue
        if q.answer is None:
            raise DataError(f"{q.where}: a benchmark question needs an answer")
        seen[key] = Question(f"{name}/{key}", q.question, q.answer, True, q.messages, q.where)
    return Benchmark(name, list(seen.values()), source)


def read_benchmark_file(path: Path) -> list[Benchmark]:
    """A parquet splits by `data_source`; a JSONL file is one benchmark named after the file."""
    if not path.is_file():
        raise DataError(f"{path}: benchmark file not found")
    if path.suffix == ".parquet":
        rows = parquet_rows(path)
        if "data_source" in pq.read_schema(path).names:
            sources = pq.read_table(path, columns=["data_source"]).column("data_source").to_pylist()
        else:
            sources = [path.stem] * len(rows)
        names: dict[str, list[Question]] = {}
        for src, q in zip(sources, rows):
            names.setdefault(src or path.stem, []).append(q)
        return [_group(n, qs, str(path)) for n, qs in names.items()]
    if path.suffix in (".jsonl", ".json"):
        return [_group(path.stem, jsonl_rows(path), str(path))]
    raise DataError(f"{path}: unknown format (expected .parquet or .jsonl)")


def resolve_benchmarks(spec: str, data_dir: Path) -> list[Benchmark]:
    """'math,arc_c' -> files in data_dir (math.parquet, ...); an item with a '/' or a suffix is a path.

    A name that is a data_source inside a file (aime, amc, ...) selects that part of `math.parquet`.
    """
    out: list[Benchmark] = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        path = Path(item)
        if "/" in item or path.suffix:
            out += read_benchmark_file(path)
            continue
        for suffix in (".parquet", ".jsonl"):
            if (data_dir / f"{item}{suffix}").is_file():
                out += read_benchmark_file(data_dir / f"{item}{suffix}")
                break
        else:
            found = [b for f in sorted(data_dir.glob("*.parquet")) for b in read_benchmark_file(f) if b.name == item]
            if not found:
                known = sorted(p.stem for p in data_dir.glob("*.parquet")) + sorted(
                    p.stem for p in data_dir.glob("*.jsonl")
                )
                raise DataError(
                    f"benchmark '{item}': no {item}.parquet/.jsonl in {data_dir} (found: {', '.join(known)})"
                )
            out.append(found[0])
    names = [b.name for b in out]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise DataError(f"benchmarks named twice: {', '.join(sorted(dupes))}")
    return out
