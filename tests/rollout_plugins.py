"""User code the rollout tests name by import path (``rollout_plugins:...``), as a recipe would."""

from __future__ import annotations

import threading

RELEASE = threading.Event()
"""Set by a test to let a sleeping reward thread end (so no thread outlives the test for long)."""


def raising_reward(prompt, completion, prompt_ids, completion_ids, **row):
    raise ValueError("this reward is broken on purpose")


def sleeping_reward(prompt, completion, prompt_ids, completion_ids, **row):
    RELEASE.wait(30.0)  # past any timeout a test sets; released at the end of the test
    return 1.0


_calls = {"n": 0}
_calls_lock = threading.Lock()


def reset_calls() -> None:
    with _calls_lock:
        _calls["n"] = 0


def _third() -> int:
    """0, 1, 2, 0, ...: the position of this call in its run of three (calls numbered from the
    last :func:`reset_calls`; a group of 3 made alone takes one run)."""
    with _calls_lock:
        k = _calls["n"] % 3
        _calls["n"] += 1
    return k


def first_of_three_raises(prompt, completion, prompt_ids, completion_ids, **row):
    """Raises on the first call of every three; scores the other two 1.0 and 0.5."""
    k = _third()
    if k == 0:
        raise ValueError("this reward is broken on purpose")
    return 1.0 if k == 1 else 0.5


def first_of_three_sleeps(prompt, completion, prompt_ids, completion_ids, **row):
    """Sleeps past any timeout on the first call of every three; scores the others 1.0 and 0.5."""
    k = _third()
    if k == 0:
        RELEASE.wait(30.0)
    return 1.0 if k == 1 else 0.5


def length_reward(prompt, completion, prompt_ids, completion_ids, **row):
    """A reward that uses every argument, so a test can check what it was given."""
    assert isinstance(completion, str) and len(prompt) == len(prompt_ids)  # char-level tokenizer
    return float(len(completion_ids))


def completion_is_answer(prompt, completion, prompt_ids, completion_ids, *, answer=None, **row):
    """1 if the completion's text is the answer, however it ended (a random model rarely ends)."""
    return float(completion == answer)


def nan_reward(prompt, completion, prompt_ids, completion_ids, **row):
    return float("nan")


async def async_reward(prompt, completion, prompt_ids, completion_ids, *, answer=None, **row):
    return 1.0 if completion == answer else 0.5


# -- a multi-turn tool workflow a random tiny model can drive ------------------------------------
# A random model never writes a well-formed tool call, so this parser turns whatever the model wrote
# in a turn into a call deterministically: the tool runs on the model's own first characters.

from asyncrl.agents.tools import ToolCall  # noqa: E402
from asyncrl.rollout.workflows import MultiTurn  # noqa: E402


def char_code_sum(text: str) -> int:
    """Sum of the character codes of ``text``."""
    return sum(ord(c) for c in text)


def first_chars_call(text: str) -> ToolCall | None:
    """Every turn's first 4 characters become a call of char_code_sum (even if the turn ended at
    EOS: the call is always made, so the test's turn structure does not depend on sampling)."""
    return ToolCall(name="char_code_sum", arguments={"text": text[:4]})


tool_workflow = MultiTurn(
    tools=[char_code_sum], parse_tool_call=first_chars_call, turn_max_new_tokens=6, max_turns=3
)


def ids_reward(prompt, completion, prompt_ids, completion_ids, **row):
    """A reward that tells completions apart (a random model's all score 0 on exact match)."""
    return sum((i + 1) * t for i, t in enumerate(completion_ids)) % 1000 / 1000


class GreedyFails:
    """One sampled turn; a greedy episode (temperature 0, ReMax's baseline) raises."""

    async def run_episode(self, ctx):
        from asyncrl.rollout.workflows import SingleTurn

        if ctx.params.temperature == 0:
            raise RuntimeError("greedy episodes fail on purpose")
        return await SingleTurn().run_episode(ctx)


greedy_fails = GreedyFails()


# -- an agent written for the OpenAI API, run as a workflow by the recording client --------------

import json  # noqa: E402

from asyncrl.agents.recording import AgentWorkflow  # noqa: E402


async def add_agent(client, row):
    """Asks the row's question with an ``add`` tool, runs the calls the model makes and asks again;
    the reward is 1 if the model used the tool. Written as for ``openai.AsyncOpenAI``."""
    from tests.tool_caller import TOOLS

    messages = [{"role": "user", "content": row["question"]}]
    r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    message = r.choices[0].message
    if not message.tool_calls:
        return 0.0
    messages.append(message)
    for call in message.tool_calls:
        args = json.loads(call.function.arguments)
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "content": str(sum(args.values()))}
        )
    await client.chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, max_tokens=6
    )
    return 1.0


add_agent_workflow = AgentWorkflow(add_agent)
