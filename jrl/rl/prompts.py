"""How a task's problems become token ids, and how sampled tokens become the text that
rewards score: chat template or plain text, system prompt, stop conditions.

Stop conditions: the tokenizer's EOS, the end-of-turn token of its chat template (e.g.
`<|im_end|>`, `<|eot_id|>`: found by rendering an assistant turn and reading the special
token that closes it), and the task's `stop` strings. A stop string stops the engine when
it tokenizes the same inside the completion as alone (always true for the byte tokenizer
and for special tokens); the text handed to rewards is cut before the first stop string
in any case, and never contains the stop token.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jrl.config import ConfigError
from jrl.data.tasks import Problem
from jrl.rollout.request import Completion
from jrl.tokenizer import template_failure

_MARK = "\x00jrl-end-of-turn-probe\x00"


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """EOS, plus the special token that closes an assistant turn in the tokenizer's chat
    template when that is another token."""
    ids = [int(tokenizer.eos_id)]
    if not getattr(tokenizer, "chat_template", None):
        return ids
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": _MARK}])
    except Exception:  # a template that refuses the probe (e.g. strict role orders): EOS alone
        return ids
    if _MARK not in text:
        return ids
    suffix = tokenizer.encode(text.split(_MARK, 1)[1])
    if suffix and tokenizer.decode(suffix[:1], skip_special_tokens=True) == "" and suffix[0] not in ids:
        ids.append(int(suffix[0]))
    return ids


def end_of_turn_text(tokenizer: Any) -> str:
    """The text of the token that ends an assistant's response: the one closing an
    assistant turn in the chat template (EOS when the template closes turns with EOS or
    has none). A demonstration response to a template-rendered prompt ends with it."""
    token = end_of_turn_ids(tokenizer)[-1]
    text = tokenizer.decode([token])
    if list(tokenizer.encode(text)) != [token]:
        raise ConfigError(f"the end-of-turn token {token} decodes to {text!r}, which does not encode back to it; "
                          f"cannot write demonstrations that end with it")
    return text


def response_text(tokenizer: Any, completion: Completion, stop_sequences: Sequence[Sequence[int]],
                  stop: Sequence[str]) -> str:
    """The text of a sampled response (a completion, or one turn of an episode): decoded
    without its stop token (finish reason `eos`) or the stop sequence it ended with
    (`stop`), and cut before the first of the `stop` strings it contains, since a stop
    string stops the engine only where it tokenizes as it does alone."""
    ids = [int(t) for t in completion.tokens]
    if completion.finish_reason == "eos":
        ids = ids[:-1]
    elif completion.finish_reason == "stop":
        for seq in stop_sequences:
            seq = list(seq)
            if ids[-len(seq):] == seq:
                ids = ids[:-len(seq)]
                break
    text = tokenizer.decode(ids)
    cuts = [text.find(s) for s in stop if s in text]
    return text[:min(cuts)] if cuts else text


class PromptFormat:
    """Renders and encodes problems for one tokenizer, and decodes completions for rewards.

    chat_template: "auto" renders message-list prompts with the tokenizer's template (and
    the generation prompt) and encodes text prompts as they are; True renders both (a text
    prompt becomes one user turn); False renders neither (message lists are refused).
    system_prompt: a system turn put first (needs the template).
    add_bos: a text prompt that the template does not render is encoded after the
    tokenizer's BOS token, as `data.add_bos` encodes training text (and jrl serve a text
    prompt to the run's checkpoints by default); a rendered prompt has the BOS its template
    writes, never a second.
    """

    def __init__(self, tokenizer: Any, *, chat_template: str | bool = "auto", system_prompt: str | None = None,
                 stop: Sequence[str] = (), add_bos: bool = False) -> None:
        if add_bos and chat_template is not True and getattr(tokenizer, "bos_id", None) is None:
            raise ConfigError("strategy.options.task.add_bos: the tokenizer (data.tokenizer) has no BOS token (no "
                              "bos_token in its tokenizer_config.json); set strategy.options.task.add_bos: false")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.add_bos = add_bos
        self.stop = tuple(stop)
        self.eos_ids = end_of_turn_ids(tokenizer)
        self.stop_sequences = [list(tokenizer.encode(s)) for s in self.stop]

    @classmethod
    def for_task(cls, tokenizer: Any, task: Any) -> PromptFormat:
        """The format of an RL task's prompts (`strategy.options.task`, a `TaskConfig`): its
        chat template choice, system prompt, stops and BOS, wherever they are encoded
        (rollouts, evaluations, the warm start's demonstrations, `jrl eval`)."""
        return cls(tokenizer, chat_template=task.chat_template, system_prompt=task.system_prompt, stop=task.stop,
                   add_bos=task.add_bos)

    def _uses_template(self, prompt: Any) -> bool:
        if self.chat_template == "auto":
            return not isinstance(prompt, str)
        return bool(self.chat_template)

    def uses_template(self, problem: Problem) -> bool:
        """Whether `problem`'s prompt is rendered with the chat template."""
        return self._uses_template(problem.prompt)

    def render(self, problem: Problem, *, turns: Sequence[dict] = (), tools: list | None = None) -> str:
        """The prompt text the model continues. `turns`: messages that followed the prompt
        (a multi-turn conversation so far), `tools`: schemas for the template's `tools=`;
        both need the chat template."""
        prompt = problem.prompt
        if (turns or tools) and not self._uses_template(prompt):
            raise ConfigError(f"{problem.where}: a conversation with turns or tools is rendered with the chat "
                              f"template, and strategy.options.task.chat_template is {self.chat_template!r} for "
                              f"this prompt (set it to true)")
        if not self._uses_template(prompt):
            if not isinstance(prompt, str):
                raise ConfigError(f"{problem.where}: the prompt is a message list, but "
                                  f"strategy.options.task.chat_template is false")
            if self.system_prompt is not None:
                raise ConfigError("strategy.options.task.system_prompt: needs the prompt rendered with the chat "
                                  "template (strategy.options.task.chat_template: true or auto with message "
                                  f"prompts); {problem.where} is text")
            return prompt
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"{problem.where}: rendering the prompt needs a chat template, and the tokenizer has none "
                              f"(give data.tokenizer a directory with one, or task.chat_template: false with text prompts)")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if self.system_prompt is not None:
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        messages += [dict(m) for m in turns]
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      **({"tools": list(tools)} if tools else {}))
        except Exception as e:  # e.g. a role the template does not know, jinja's UndefinedError: name the record
            raise ConfigError(f"{problem.where}: the chat template cannot render the prompt: "
                              f"{template_failure(e)}") from None

    def encode(self, problem: Problem) -> np.ndarray:
        """int32 prompt ids: the special tokens the template writes, or for a text prompt the
        BOS when `add_bos`, and no other."""
        bos = [self.tokenizer.bos_id] if self.add_bos and not self.uses_template(problem) else []
        return np.asarray(bos + list(self.tokenizer.encode(self.render(problem))), np.int32)

    def completion_text(self, completion: Completion) -> str:
        """The decoded response without its stop token or stop string, cut before the
        first stop string it contains (`response_text`)."""
        return response_text(self.tokenizer, completion, self.stop_sequences, self.stop)

    def generate_kwargs(self) -> dict[str, Any]:
        """The engine's stop arguments."""
        return {"eos_ids": self.eos_ids, "stop_sequences": self.stop_sequences}
