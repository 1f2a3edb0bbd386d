"""Offline batch generation: ``LLM(...).generate(prompts, sampling_params)``, and
``LLM(...).chat(conversations, sampling_params)`` as vLLM's; embeddings with
``LLM(runner="pooling").embed(prompts)``.

    with LLM(max_num_seqs=64) as llm:
        for c in llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=16)):
            print(c.text)

Under the hood it starts the same scheduler and executor processes as
``weir serve`` (on a free local port, metrics on free ports too), submits every
prompt at once so they batch together, and stops the processes on ``close()``.
"""

from __future__ import annotations

import asyncio
import io
import os
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypedDict, TypeGuard, TypeVar

from PIL import Image as PILImage
from tqdm import tqdm

from weir.services.launcher import ServerProcesses
from weir.shared.beam_search import BeamSearchOutput, BeamSearchParams
from weir.shared.client import (
    AsyncWeirClient,
    ClassificationOutput,
    EmbeddingOutput,
    EventLoopThread,
    ScoreOutput,
    WeirError,
    gather_all,
)
from weir.shared.config import EngineArgs
from weir.shared.hub_cache import resolve_hub_ids
from weir.shared.model_store import resolve_model
from weir.shared.pooling import cosine, score_pairs
from weir.shared.protocol.client import Prompt
from weir.shared.sampling import SamplingParams, sample_seed
from weir.shared.sampling_defaults import default_params

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing's from Python 3.13

T = TypeVar("T")
PromptT = TypeVar("PromptT", bound=Prompt)
# vLLM's use_tqdm: a progress bar of the prompts done, or a tqdm-like class to make it.
UseTqdm = bool | Callable[..., Any]
# A text, token ids or vLLM's prompt dict ({"prompt": text} or {"prompt_token_ids": ids}),
# or a list of them.
OnePromptOrMany = str | list[int] | dict[str, Any] | Sequence[str | list[int] | dict[str, Any]]
# What generate takes: the same, chat messages too.
PromptOrMany = Prompt | dict[str, Any] | Sequence[Prompt | dict[str, Any]]


class _PoolingOptions(TypedDict):
    """The options ``score`` gives each request, a pair's or (an embedding model's) a text's."""

    truncate_prompt_tokens: int | None
    lora_name: str | None


@dataclass(slots=True)
class Completion:
    """One prompt's completion: vLLM's ``RequestOutput`` and its first ``CompletionOutput``
    in one. With ``SamplingParams.n`` > 1, ``outputs`` holds the prompt's n samples (this
    one first), each a ``Completion`` of its own ``index``."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    # The prompt's text as given (vLLM's ``RequestOutput.prompt``); None for token ids or a
    # chat.
    prompt: str | None = None
    # With ``SamplingParams.prompt_logprobs``: per prompt token, the logprob of it and of the
    # most likely ones there, by token id (vLLM's; None for the first, which nothing predicts).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # With ``SamplingParams.logprobs``: per output token, the logprob of it and of the most
    # likely ones, by token id (vLLM's ``CompletionOutput.logprobs``).
    logprobs: list[dict[int, float]] | None = None
    # The stop string or stop token id that ended it (vLLM's); None for the end token or a
    # length cut.
    stop_reason: str | int | None = None
    # With ``SamplingParams.logprobs``: the sum of the output tokens' logprobs (vLLM's).
    cumulative_logprob: float | None = None
    # Of the prompt's tokens, how many the prefix cache held (vLLM's).
    num_cached_tokens: int = 0
    index: int = 0  # which of the prompt's n samples it is (vLLM's CompletionOutput.index)
    samples: list[Completion] | None = field(default=None, repr=False)  # n > 1: all n

    @property
    def outputs(self) -> list[Completion]:
        """vLLM's ``RequestOutput.outputs``: the prompt's samples (this one alone for n=1)."""
        return [self] if self.samples is None else self.samples

    @property
    def finished(self) -> bool:
        """vLLM's ``RequestOutput.finished``: an ``LLM`` returns finished requests only."""
        return True


class LLM:
    """A private server for batch jobs. ``model=None`` is the default model; other keyword
    arguments are engine options named like the ``weir serve`` flags
    (``max_num_batched_tokens=32``, ``kv_cache_memory="64MiB"``, ``device="cpu"``,
    ``tokenizer="DIR"``...)."""

    def __init__(
        self,
        model: str | None = None,
        *,
        startup_timeout: float = 600.0,
        download_dir: str | None = None,
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        **engine_options: Any,
    ) -> None:
        # vLLM's: a Hub repo id read from the Hugging Face cache (download_dir's), at that
        # revision (hub_cache.resolve_hub_ids).
        options = resolve_hub_ids(
            {"model": model, **engine_options}, download_dir, revision, tokenizer_revision
        )
        self._server = ServerProcesses(
            EngineArgs(**options),
            port=0,
            metrics_port=0,
            executor_metrics_port=0,
            startup_timeout=startup_timeout,
            offline=True,
        )
        self.server_info = self._server.start()
        self._loop = EventLoopThread("LLM")
        try:
            address, keys_dir = self._server.client_address, self._server.engine_args.keys_dir
            self._open_client = self._loop.call(
                lambda: AsyncWeirClient(address, timeout=60.0, keys_dir=keys_dir)
            )
        except BaseException:
            self._loop.stop()
            self._server.shutdown()
            raise
        # An LLM dropped without close() (or alive at exit) still stops its processes.
        self._finalizer = weakref.finalize(
            self, _close, self._loop, self._open_client, self._server
        )

    @property
    def _client(self) -> AsyncWeirClient:
        """The client, asked for before each call builds its coroutines: a closed LLM's
        calls raise ``WeirError``."""
        if not self._finalizer.alive:
            raise WeirError("LLM is closed")
        self._loop.check_process()  # in a fork, whose server is its parent's
        if (exited := self._server.exited) is not None:  # else each call waits its timeout
            name, code = exited
            raise WeirError(f"the LLM's {name} exited (code {code}): close it and start another")
        return self._open_client

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptOrMany,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: int | Sequence[int] | None = None,
        lora_name: str | Sequence[str | None] | None = None,
        use_tqdm: UseTqdm = True,
    ) -> list[Completion]:
        """One ``Completion`` per prompt, in prompt order; a prompt is text, token ids, chat
        messages (``[{"role": "user", "content": "..."}]``) or vLLM's prompt dicts
        (``{"prompt": text}``, ``{"prompt_token_ids": ids}``, with images for a model that
        reads them: ``{"prompt": "<image>...", "multi_modal_data": {"image": image}}``, an
        image a PIL image or its encoded bytes, or a list of them, one for each
        ``<image>``). If one fails, the call
        raises its error and the others are aborted. ``priority``: one for every prompt or
        one per prompt, lower first (with ``policy="priority"``). ``lora_name``: the LoRA adapter (of
        ``lora_modules``) of every prompt, or one per prompt (None: the base model).
        ``use_tqdm`` (vLLM's, as every batch method here): a progress bar on stderr, or
        the tqdm-like class that makes it."""
        batch = [prompts] if _is_one_prompt(prompts) else prompts
        return self._run(
            [_vllm_prompt(p) for p in batch],
            sampling_params,
            priority,
            lora_name,
            {},
            use_tqdm,
            [_prompt_images(p) for p in batch],
        )

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        priority: int | Sequence[int] | None = None,
        lora_name: str | Sequence[str | None] | None = None,
        use_tqdm: UseTqdm = True,
    ) -> list[Completion]:
        """One ``Completion`` per conversation (one, or a list of them), rendered by the
        model's chat template with ``tools`` and the other template arguments, as vLLM's
        ``LLM.chat`` (and the chat API) render them."""
        if not isinstance(messages, list | tuple):
            raise TypeError(
                "messages must be a conversation (a list of messages) or a list of them"
            )
        conversations = _conversations(messages)
        chat = {
            "tools": tools,
            "chat_template_kwargs": chat_template_kwargs,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }
        return self._run(list(conversations), sampling_params, priority, lora_name, chat, use_tqdm)

    def _run(
        self,
        prompts: list[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: int | Sequence[int] | None,
        lora_name: str | Sequence[str | None] | None,
        chat: dict[str, Any],
        use_tqdm: UseTqdm,
        images: list[list[bytes]] | None = None,
    ) -> list[Completion]:
        """``chat``: the client's keyword arguments of every prompt; ``images``: each
        prompt's images."""
        if sampling_params is None:
            # vLLM's LLM too samples with the model's recommended defaults when given none.
            info = self._loop.run(self._client.model_info())
            params = [default_params(info["default_sampling_params"])] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        if priority is None or isinstance(priority, int):
            priorities = [priority or 0] * len(prompts)
        elif isinstance(priority, list | tuple) and all(isinstance(p, int) for p in priority):
            priorities = list(priority)
        else:
            raise TypeError(
                f"priority must be an int or a list of ints (one per prompt), not {priority!r:.80}"
            )
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        if lora_name is None or isinstance(lora_name, str):
            loras = [lora_name] * len(prompts)
        elif isinstance(lora_name, list | tuple) and all(
            name is None or isinstance(name, str) for name in lora_name
        ):
            loras = list(lora_name)
        else:
            raise TypeError(
                "lora_name must be an adapter's name, None, or a list of them (one per prompt), "
                f"not {lora_name!r:.80}"
            )
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_names for {len(prompts)} prompts")
        client = self._client
        pictures = images or [[]] * len(prompts)
        return self._all(
            [
                _generate_samples(client, p, sp, pr, lora, {**chat, "images": i} if i else chat)
                for p, sp, pr, lora, i in zip(prompts, params, priorities, loras, pictures)
            ],
            use_tqdm,
        )

    def embed(
        self,
        prompts: OnePromptOrMany,
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        lora_name: str | None = None,
        use_tqdm: UseTqdm = True,
    ) -> list[EmbeddingOutput]:
        """One embedding per prompt (text or token ids), in prompt order, from an ``LLM``
        with the pooling runner (``runner="pooling"``, or an embedding model), through the
        LoRA adapter ``lora_name`` if given; each one's ``embedding`` is a list of floats.
        If one fails, the call raises its error."""
        batch = _pooling_prompts(prompts)
        client = self._client
        embeddings = [
            client.embed(
                p,
                dimensions=dimensions,
                normalize=normalize,
                truncate_prompt_tokens=truncate_prompt_tokens,
                lora_name=lora_name,
            )
            for p in batch
        ]
        return self._all(embeddings, use_tqdm)

    def classify(
        self,
        prompts: OnePromptOrMany,
        *,
        activation: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        lora_name: str | None = None,
        use_tqdm: UseTqdm = True,
    ) -> list[ClassificationOutput]:
        """One classification per prompt (text or token ids), in prompt order, from an
        ``LLM`` of a sequence classifier (a ``*ForSequenceClassification`` checkpoint, which
        takes the pooling runner by itself); each one's ``probs`` holds a score per label
        (the logits with ``activation=False``). If one fails, the call raises its error."""
        batch = _pooling_prompts(prompts)
        client = self._client
        classifications = [
            client.classify(
                p,
                activation=activation,
                truncate_prompt_tokens=truncate_prompt_tokens,
                lora_name=lora_name,
            )
            for p in batch
        ]
        return self._all(classifications, use_tqdm)

    def beam_search(
        self,
        prompts: OnePromptOrMany,
        params: BeamSearchParams,
        *,
        lora_name: str | None = None,
        use_tqdm: UseTqdm = True,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: each prompt's best ``params.beam_width`` beams, best
        first (``weir.shared.beam_search``), the prompts searched together. If one fails,
        the call raises its error."""
        batch = _pooling_prompts(prompts)
        client = self._client
        searches = [client.beam_search(p, params, lora_name=lora_name) for p in batch]
        return self._all(searches, use_tqdm)

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        lora_name: str | None = None,
        use_tqdm: UseTqdm = True,
    ) -> list[ScoreOutput]:
        """vLLM's ``LLM.score``: ``text_1`` against each ``text_2`` (one text against many),
        or pair by pair; a cross-encoder (a sequence classifier of one label) scores each pair
        encoded together, an embedding model by the cosine similarity of the two texts'
        embeddings. If one fails, the call raises its error."""
        pairs = score_pairs(text_1, text_2)
        options = _PoolingOptions(
            truncate_prompt_tokens=truncate_prompt_tokens, lora_name=lora_name
        )
        client = self._client
        if self._loop.run(client.model_info()).get("labels"):
            return self._all([client.score(a, b, **options) for a, b in pairs], use_tqdm)
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        embedded = dict(
            zip(texts, self._all([client.embed(t, **options) for t in texts], use_tqdm))
        )
        return [
            ScoreOutput(
                f"{embedded[a].request_id}+{embedded[b].request_id}",
                cosine(embedded[a].data, embedded[b].data),
                embedded[a].prompt_token_ids + embedded[b].prompt_token_ids,
            )
            for a, b in pairs
        ]

    def reset_prefix_cache(self) -> None:
        """vLLM's: later prompts read no block cached before this call."""
        self._loop.run(self._client.reset_prefix_cache())

    def update_weights_from_disk(self, model_path: str | os.PathLike[str]) -> None:
        """Generate with the weights of model directory ``model_path`` from now on (a
        trainer's checkpoint of the served model: its config.json the same architecture), as
        SGLang's ``update_weights_from_disk``; ``InvalidRequestError`` where they do not fit
        or cannot be loaded, and the weights before go on serving."""
        self._loop.run(self._client.update_weights_from_disk(os.fspath(model_path)))

    def sleep(self, level: int = 1) -> None:
        """vLLM's ``LLM.sleep``: free the KV cache and, at ``level`` 1, move the weights to
        host memory (on a GPU), at level 2 free them too, until ``wake_up`` (which reads them
        again from disk); for a trainer that needs the device between rollouts."""
        self._loop.run(self._client.sleep(level))

    def start_profile(self) -> None:
        """vLLM's ``LLM.start_profile``: the executors record torch.profiler traces of the
        steps until ``stop_profile`` (an LLM made with ``profiler_dir``)."""
        self._loop.run(self._client.start_profile())

    def stop_profile(self) -> None:
        """vLLM's ``LLM.stop_profile``: each executor writes its trace (Chrome/Perfetto JSON)
        and a table of its costliest operators and kernels under ``profiler_dir``."""
        self._loop.run(self._client.stop_profile())

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's ``LLM.wake_up``: ``tags`` ["weights"] first, then ["kv_cache"], to load new
        weights (``update_weights_from_disk``) before the KV cache takes its memory back."""
        self._loop.run(self._client.wake_up(tags))

    def is_sleeping(self) -> bool:
        return self._loop.run(self._client.is_sleeping())

    def get_tokenizer(self) -> Any:
        """vLLM's ``LLM.get_tokenizer``: the model's Hugging Face tokenizer, or
        ``tokenizer``'s where one was given (transformers' ``AutoTokenizer``, for
        ``apply_chat_template`` and the like in a client's own code; the server tokenizes
        with the same ``tokenizer.json``)."""
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError(
                "LLM.get_tokenizer returns a transformers tokenizer: pip install transformers"
            ) from None
        args = self._server.engine_args
        return AutoTokenizer.from_pretrained(
            args.tokenizer or resolve_model(args.model, load_format=args.load_format)
        )

    def close(self) -> None:
        self._finalizer()

    def _all(self, awaitables: Sequence[Awaitable[T]], use_tqdm: UseTqdm) -> list[T]:
        """Every result, in order (``gather_all``), counted on a progress bar where asked."""
        if not use_tqdm:
            return self._loop.run(gather_all(awaitables))
        bar = (use_tqdm if callable(use_tqdm) else tqdm)(
            total=len(awaitables), desc="Processed prompts", dynamic_ncols=True
        )

        async def counted(awaitable: Awaitable[T]) -> T:
            result = await awaitable
            bar.update(1)
            return result

        try:
            return self._loop.run(gather_all([counted(a) for a in awaitables]))
        finally:
            bar.close()


async def _generate_samples(
    client: AsyncWeirClient,
    prompt: Prompt,
    params: SamplingParams,
    priority: int,
    lora_name: str | None,
    chat: dict[str, Any],
) -> Completion:
    """The prompt's ``params.n`` samples, each its own request (seed + i where seeded, as
    vLLM's); the others are sent once the first has an output, so that they find its prompt
    in the prefix cache."""
    request = (prompt, priority, lora_name, chat)
    if params.n == 1:
        return await _generate_one(client, params, *request)
    samples = [replace(params, n=1, seed=sample_seed(params.seed, i)) for i in range(params.n)]
    started = asyncio.Event()
    first = asyncio.ensure_future(_generate_one(client, samples[0], *request, started))
    try:
        waiting = asyncio.ensure_future(started.wait())
        try:
            await asyncio.wait((first, waiting), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
        if first.done():
            first.result()  # a refused prompt: its error, and no more requests
        rest = (_generate_one(client, p, *request, index=i) for i, p in enumerate(samples[1:], 1))
        done = await gather_all([first, *rest])
    finally:
        first.cancel()  # cancelled while it runs: its stream closes, which aborts it
    done[0].samples = done
    return done[0]


async def _generate_one(
    client: AsyncWeirClient,
    params: SamplingParams,
    prompt: Prompt,
    priority: int,
    lora_name: str | None,
    chat: dict[str, Any],
    started: asyncio.Event | None = None,
    index: int = 0,
) -> Completion:
    """One request's completion; ``started`` is set at its first output."""
    completion = Completion("", [], [], "", None, index=index)
    if params.logprobs is not None:
        completion.logprobs = []
    texts = []
    if isinstance(prompt, str):
        completion.prompt = prompt
    # vLLM's offline LLM cuts a max_tokens past max_model_len to what fits (its API refuses).
    stream = client.generate(
        prompt, params, priority=priority, lora_name=lora_name, cap_max_tokens=True, **chat
    )
    async for out in stream:
        if started is not None:
            started.set()
        completion.request_id = out.request_id
        if out.prompt_token_ids is not None:
            completion.prompt_token_ids = out.prompt_token_ids
        if out.num_cached_tokens is not None:
            completion.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            prompt_rows = zip(
                out.prompt_logprobs["token_ids"], out.prompt_logprobs["logprobs"], strict=True
            )
            # The first row is the first prompt token's, whose logprob is None.
            completion.prompt_logprobs = [
                None if lps[0] is None else dict(zip(ids, lps, strict=True))
                for ids, lps in prompt_rows
            ]
        if out.logprobs is not None and completion.logprobs is not None:
            rows = zip(out.logprobs["token_ids"], out.logprobs["logprobs"], strict=True)
            completion.logprobs += [dict(zip(ids, lps, strict=True)) for ids, lps in rows]
        completion.token_ids += out.new_token_ids
        texts.append(out.text)
        completion.finish_reason = out.finish_reason
        completion.stop_reason = out.stop_reason
    completion.text = "".join(texts)
    if completion.logprobs is not None:
        completion.cumulative_logprob = sum(
            row[token] for row, token in zip(completion.logprobs, completion.token_ids)
        )
    return completion


def _close(loop: EventLoopThread, client: AsyncWeirClient, server: ServerProcesses) -> None:
    """``LLM.close()``, or the finalizer of an LLM dropped without it; in a fork nothing (the
    processes are the parent's)."""

    def close() -> None:
        loop.run(client.close())
        loop.stop()
        server.shutdown()

    loop.finalize(close)


def _is_vllm_prompt(prompt: object) -> TypeGuard[dict[str, Any]]:
    return isinstance(prompt, dict) and ("prompt" in prompt or "prompt_token_ids" in prompt)


def _is_one_prompt(prompts: PromptOrMany) -> TypeIs[Prompt | dict[str, Any]]:
    """Whether ``generate`` was given a single prompt (text, token ids, a chat or vLLM's
    prompt dict), not a list of them."""
    return isinstance(prompts, str | dict) or (
        bool(prompts) and isinstance(prompts[0], int | dict) and not _is_vllm_prompt(prompts[0])
    )


def _is_conversation(
    messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
) -> TypeIs[list[dict[str, Any]]]:
    """Whether ``chat`` was given one conversation (a list of messages), not a list of them."""
    return bool(messages) and isinstance(messages[0], dict)


def _conversations(
    messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
) -> Sequence[list[dict[str, Any]]]:
    """``chat``'s conversations, given one or a list of them."""
    return [messages] if _is_conversation(messages) else messages


def _is_one_pooling_prompt(prompts: OnePromptOrMany) -> TypeIs[str | list[int] | dict[str, Any]]:
    """Whether a pooling method was given a single prompt (text, token ids or vLLM's prompt
    dict), not a list of them."""
    return isinstance(prompts, str | dict) or (bool(prompts) and isinstance(prompts[0], int))


def _vllm_prompt(prompt: PromptT | dict[str, Any]) -> PromptT | str | list[int]:
    """A prompt as Weir takes it: vLLM's ``TextPrompt`` is its text, its ``TokensPrompt``
    its token ids (a prompt dict with other keys is refused: Weir does not take them)."""
    if not _is_vllm_prompt(prompt):
        # As given, a dict of neither key too: the client refuses what is no prompt
        # (validate_prompt).
        return prompt  # type: ignore[return-value]
    if len(prompt.keys() - {"multi_modal_data"}) != 1:
        raise ValueError(
            "a prompt dict holds one of 'prompt' (text) or 'prompt_token_ids', and may hold "
            f"'multi_modal_data', not {sorted(prompt)}"
        )
    # Unchecked, as any prompt given: the client checks it.
    text_or_ids: str | list[int] = (
        prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
    )
    return text_or_ids


def _prompt_images(prompt: object) -> list[bytes]:
    """The encoded images of vLLM's prompt dict's ``multi_modal_data`` (``{"image": IMAGE
    or [IMAGE, ...]}``, each a PIL image, saved as PNG, or encoded bytes); none elsewhere."""
    data = prompt.get("multi_modal_data") if _is_vllm_prompt(prompt) else None
    if data is None:
        return []
    if not isinstance(data, dict) or data.keys() != {"image"}:
        raise ValueError('multi_modal_data holds {"image": an image or a list of them}')
    images = data["image"] if isinstance(data["image"], list | tuple) else [data["image"]]
    return [_encoded(image) for image in images]


def _encoded(image: object) -> bytes:
    if isinstance(image, bytes):
        return image
    if isinstance(image, PILImage.Image):
        out = io.BytesIO()
        image.save(out, format="PNG")  # lossless: the pixels the processor reads are these
        return out.getvalue()
    raise TypeError(f"an image is a PIL image or its encoded bytes, not {type(image).__name__}")


def _pooling_prompts(prompts: OnePromptOrMany) -> list[str | list[int]]:
    """Prompts given one (text, token ids or vLLM's prompt dict) or many, as a list."""
    batch = [prompts] if _is_one_pooling_prompt(prompts) else prompts
    return [_vllm_prompt(p) for p in batch]
