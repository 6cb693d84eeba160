"""The checks of the models the rollouts ask besides the policy (the reward model, the teacher):
urls of servers the user started or a folder `asyncrl run` serves, and for the teacher, that it
goes with ``algorithm.advantage: distill`` and shares the student's tokenizer
(:func:`tokenizer_difference`). Each is one named check of :data:`asyncrl.recipe.checks.CHECKS`.
"""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.recipe.fields import RecipeError
from asyncrl.recipe.schema import Recipe

_SERVED = {
    "reward_model": (
        "reward model folder",
        "an HF sequence-classification folder, e.g. a reward_model run's hf/latest",
    ),
    "teacher": ("teacher folder", "an HF causal LM folder, e.g. a run's hf/latest"),
}
"""Each served model's section of ``rollout`` -> (what its folder is called, what it must be)."""


def _check_model_servers(r: Recipe, name: str, file: str | None, check_files: bool) -> None:
    """A model served for the rollouts (``rollout.<name>``: the reward model, the teacher): urls of
    servers the user started, or a folder `asyncrl run` serves; never both, the folder an HF one,
    the urls http(s)."""
    key, (what, kind) = f"rollout.{name}", _SERVED[name]
    path, urls = getattr(r.rollout, name).path, getattr(r.rollout, name).urls
    if path and urls:
        raise RecipeError(
            "give urls (servers you started) or path (`asyncrl run` starts servers on it), "
            "not both",
            file=file,
            key=f"{key}.path",
        )
    if check_files and path and not (r.resolve(path) / "config.json").is_file():
        raise RecipeError(
            f"{what} {path!r} has no config.json ({kind})", file=file, key=f"{key}.path"
        )
    for i, u in enumerate(urls):
        if not u.startswith(("http://", "https://")):
            raise RecipeError(
                f"expected an http(s):// URL, got {u!r}", file=file, key=f"{key}.urls[{i}]"
            )


def reward_model_servers(r: Recipe, file: str | None, check_files: bool) -> None:
    """``rollout.reward_model``: urls or an HF sequence-classification folder, not both."""
    _check_model_servers(r, "reward_model", file, check_files)


def _distill(r: Recipe) -> bool:
    return r.algorithm.advantage == "distill" and r.algorithm.uses_rollouts


def teacher_and_distill(r: Recipe, file: str | None, check_files: bool) -> None:
    """``algorithm.advantage: distill`` and ``rollout.teacher`` go together (a teacher no advantage
    reads would be served and asked for nothing)."""
    alg, t = r.algorithm, r.rollout.teacher
    distill = _distill(r)
    if distill and not t.enabled:
        raise RecipeError(
            "algorithm.advantage distill needs a teacher: set rollout.teacher.path (a causal LM "
            "folder `asyncrl run` serves) or rollout.teacher.urls (/generate servers)",
            file=file,
            key="rollout.teacher",
        )
    if t.enabled and not distill:
        raise RecipeError(
            f"a teacher is read by algorithm.advantage distill only, not {alg.advantage}"
            + (f" with loss {alg.loss}" if not alg.uses_rollouts else "")
            + ": set the advantage to distill, or leave rollout.teacher empty",
            file=file,
            key="rollout.teacher",
        )


def distill_coef(r: Recipe, file: str | None, check_files: bool) -> None:
    """``algorithm.distill_coef`` weighs a reward inside the distill advantage only."""
    if r.algorithm.distill_coef and r.algorithm.advantage != "distill":
        raise RecipeError(
            "weighs the outcome reward inside the distill advantage: set algorithm.advantage "
            "distill, or leave it 0",
            file=file,
            key="algorithm.distill_coef",
        )


def distill_temperature(r: Recipe, file: str | None, check_files: bool) -> None:
    """Distillation samples at T = 1.

    The teacher's logprobs are untempered (SGLang's input logprobs are log_softmax(z)), the
    student's log_softmax(z / T): A_t would pull the tempered student to the untempered teacher,
    and one token's logprob cannot be re-tempered without the whole vocabulary."""
    if _distill(r) and r.rollout.temperature != 1:
        raise RecipeError(
            f"{r.rollout.temperature:g} with algorithm.advantage distill: the teacher's logprobs "
            "are untempered, so at T != 1 the student would learn a teacher whose logits are "
            "scaled by T, not the teacher; set it 1 (docs/distill.md)",
            file=file,
            key="rollout.temperature",
        )


def distill_dynamic_sampling(r: Recipe, file: str | None, check_files: bool) -> None:
    """Distillation keeps groups of equal rewards: its advantage is the teacher's, per token."""
    if _distill(r) and r.buffer.dynamic_sampling:
        raise RecipeError(
            "drops groups whose rewards are all equal, but the distill advantage is the teacher's, "
            "per token, whatever the rewards: set it false",
            file=file,
            key="buffer.dynamic_sampling",
        )


def teacher_servers(r: Recipe, file: str | None, check_files: bool) -> None:
    """``rollout.teacher``: urls or an HF causal LM folder, not both."""
    _check_model_servers(r, "teacher", file, check_files)


def teacher_tokenizer(r: Recipe, file: str | None, check_files: bool) -> None:
    """A teacher folder has the student's tokenizer: it scores the student's token ids."""
    t = r.rollout.teacher
    if check_files and t.path and r.model.path:
        differs = tokenizer_difference(r.resolve(r.model.path), r.resolve(t.path))
        if differs:
            raise RecipeError(
                f"the teacher's tokenizer is not the student's ({differs}): the teacher scores the "
                "student's token ids, which must mean the same text to both",
                file=file,
                key="rollout.teacher.path",
            )


TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt")
"""The files that define an HF tokenizer's token ids (one format or another)."""


def tokenizer_difference(student: Path, teacher: Path) -> str:
    """Why two HF folders' token ids may not mean the same text ("" when they do): a tokenizer
    file one has and the other lacks or holds otherwise (tokenizer.json compared by its vocabulary
    and added tokens, the rest byte for byte); with no such file to compare, their config.json
    ``vocab_size``."""
    compared = False
    for name in TOKENIZER_FILES:
        a, b = student / name, teacher / name
        if not a.is_file() and not b.is_file():
            continue
        if a.is_file() != b.is_file():
            return f"{name} in one folder only"
        compared = True
        if name == "tokenizer.json":
            ja, jb = (json.loads(x.read_text()) for x in (a, b))
            same = all(ja.get(k) == jb.get(k) for k in ("model", "added_tokens"))
        else:
            same = a.read_bytes() == b.read_bytes()
        if not same:
            return f"{name} differs"
    if compared:
        return ""
    sizes = []
    for folder in (student, teacher):
        try:
            sizes.append(json.loads((folder / "config.json").read_text()).get("vocab_size"))
        except (OSError, ValueError):
            sizes.append(None)
    if sizes[0] != sizes[1]:
        return f"vocab_size {sizes[0]} vs {sizes[1]}"
    return ""
