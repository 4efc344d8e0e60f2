"""The judge: one model behind an OpenAI-compatible endpoint (OpenAI, vLLM, ``transformers serve``, llama.cpp).

:class:`JudgeClient` wraps the ``openai`` v1 client (imported when a judge is first made, so that the package imports
without it) with bounded retries on transport errors, and turns a server's refusals into one-line messages that name
the URL, the judge model or the key's variable, never the key.

May import: errors, mt_bench.config.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from ..errors import FoRAInputError
from .config import DEFAULT_KEY_ENV, MTBenchConfig


__all__ = ["NO_KEY", "JudgeClient"]

# What a local server without authentication gets as a key (the client needs one; vLLM's docs use this word).
NO_KEY = "EMPTY"


class JudgeClient:
    """One judge model behind an OpenAI-compatible endpoint, with bounded retries on transport errors.

    Transport errors (no connection, timeout, 429, 5xx) are retried ``judge_retries`` times in all, waiting
    ``judge_retry_wait`` seconds doubled each time; then the run stops with a message. Any other refusal of the server
    (bad key, unknown model, a rejected request) stops it at once: retrying cannot fix it.
    """

    def __init__(self, config: MTBenchConfig):
        try:
            import openai
        except ImportError as err:
            raise ImportError(
                'MT-Bench judging needs the openai client (v1 or later): pip install "fora-plugin[mt-bench]"'
            ) from err
        self.config = config
        self.url = config.judge_base_url or "https://api.openai.com/v1"
        env = config.judge_api_key_env or DEFAULT_KEY_ENV
        key = os.environ.get(env)
        if not key:
            if config.judge_api_key_env is not None or config.judge_base_url is None:
                raise FoRAInputError(
                    f"the judge's API key variable ${env} is not set (or empty): export {env}=<your key>, or name "
                    "the variable that holds it with --judge-api-key-env."
                )
            key = NO_KEY  # a local server with no authentication; the variable was not asked for
        self.key_env = env
        self.requests = 0
        # The HTTP client logs every request at INFO, which would bury the progress bar; errors still show.
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
        # Retries are ours (bounded, counted, named in the message); the client's own would hide them.
        self._client = openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=config.judge_timeout)
        self._openai = openai

    def __repr__(self) -> str:  # never shows the key
        return f"JudgeClient(model={self.config.judge_model!r}, url={self.url!r}, key from ${self.key_env})"

    def _refusal(self, error: Exception) -> FoRAInputError:
        openai = self._openai
        if isinstance(error, openai.AuthenticationError | openai.PermissionDeniedError):
            return FoRAInputError(
                f"the judge at {self.url} refused the API key in ${self.key_env} ({error.status_code}): set "
                f"{self.key_env} to a valid key for that server."
            )
        if isinstance(error, openai.NotFoundError):
            return FoRAInputError(
                f"the judge at {self.url} does not serve judge model {self.config.judge_model!r} (404): name a "
                "model it serves (GET /v1/models lists them)."
            )
        detail = getattr(error, "message", str(error))
        return FoRAInputError(
            f"the judge at {self.url} refused a request for judge model {self.config.judge_model!r} "
            f"({getattr(error, 'status_code', '?')}): {detail:.300}"
        )

    def _transport(self, error: Exception) -> bool:
        openai = self._openai
        return isinstance(error, openai.APIConnectionError | openai.RateLimitError | openai.InternalServerError)

    def check(self) -> None:
        """Refuse, before any answer is generated, a server that is unreachable or does not serve the judge."""
        openai = self._openai
        try:
            served = [m.id for m in self._client.models.list()]
        except openai.APIConnectionError as error:
            raise FoRAInputError(
                f"the judge URL {self.url} is unreachable ({type(error).__name__}: {error}): start the server or fix "
                "--judge-base-url."
            ) from None
        except openai.NotFoundError:
            return  # a server without GET /v1/models: the first judgment will tell
        except openai.APIStatusError as error:
            raise self._refusal(error) from None
        if served and self.config.judge_model not in served:
            raise FoRAInputError(
                f"the judge at {self.url} does not serve judge model {self.config.judge_model!r}; it serves: "
                f"{', '.join(served[:20])}{' ...' if len(served) > 20 else ''}."
            )

    def complete(self, system_prompt: str, user_prompt: str, kept: Callable[[], str]) -> str:
        """The judge's reply at temperature 0; ``kept()`` says where finished judgments are, for the message."""
        messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": user_prompt}]
        wait = self.config.judge_retry_wait
        for attempt in range(1, self.config.judge_retries + 1):
            try:
                self.requests += 1
                response = self._client.chat.completions.create(
                    model=self.config.judge_model,
                    messages=messages,
                    n=1,
                    temperature=0,
                    max_tokens=self.config.judge_max_tokens,
                )
                return response.choices[0].message.content or ""
            except self._openai.APIStatusError as error:
                if not self._transport(error):
                    raise self._refusal(error) from None
                last = error
            except self._openai.APIConnectionError as error:
                last = error
            if attempt < self.config.judge_retries:
                time.sleep(wait)
                wait *= 2
        # The user's server is down: a one-line message that says how to resume, not a traceback.
        raise FoRAInputError(
            f"the judge URL {self.url} failed {self.config.judge_retries} tries in a row ({type(last).__name__}: "
            f"{last}); {kept()}. Bring the server back and re-run the same command: it resumes."
        ) from None
