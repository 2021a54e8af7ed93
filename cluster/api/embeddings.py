"""The OpenAI embeddings API (`POST /v1/embeddings`): request and response models, and how a
pooled vector is returned. The route itself lives with the others in `cluster.api.server`.

- `input`: a string, a list of strings, a token-id list or a list of token-id lists (at most
  `MAX_EMBEDDING_INPUTS`); none may be empty.
- `encoding_format`: "float" (a JSON list) or "base64" (the little-endian float32 bytes, as
  OpenAI encodes them; the `openai` client asks for base64 by default and decodes it).
- `dimensions`: keep the first d components and renormalise them to unit length (Matryoshka
  truncation), where the model allows it: its config.json declares `matryoshka_dimensions`
  (then d must be one of them) or `is_matryoshka: true` (any d up to its size). Any other model
  answers 400 unless d is its full size; larger than the embedding size is a 400.
- `usage`: prompt_tokens == total_tokens, the tokens of every input.
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Literal

from pydantic import BaseModel, ConfigDict

from cluster.engine.client import ChoiceResult, GenerationFailed
from workers.sampling_params import SamplingParamsError

MAX_EMBEDDING_INPUTS = 2048  # as OpenAI


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted, ignored

    def inputs(self) -> list[str | list[int]]:
        """One entry per embedding; raises SamplingParamsError (a 400 naming the field)."""
        p = self.input
        out: list[str | list[int]]
        if isinstance(p, str):
            out = [p]
        elif p and all(isinstance(x, int) for x in p):
            out = [list(p)]  # type: ignore[arg-type]
        else:
            out = list(p)  # type: ignore[arg-type]
        if not out or any(len(x) == 0 for x in out):
            raise SamplingParamsError("input", "the input must not be empty, nor contain an empty entry")
        if len(out) > MAX_EMBEDDING_INPUTS:
            raise SamplingParamsError("input", f"at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(out)}")
        if self.dimensions is not None and self.dimensions < 1:
            raise SamplingParamsError("dimensions", f"must be >= 1, got {self.dimensions}")
        return out


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbeddingData(_Out):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(_Out):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Out):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def check_dimensions(dimensions: int, size: int, matryoshka: tuple[int, ...] | None) -> None:
    """Raise (a 400 naming `dimensions`) unless the model's `size`-long embeddings may be cut to
    `dimensions` (see the module docstring)."""
    if dimensions == size:
        return
    if dimensions > size:
        raise SamplingParamsError(
            "dimensions", f"this model's embeddings have {size} dimensions; {dimensions} were requested")
    if matryoshka is None:
        raise SamplingParamsError(
            "dimensions", f"this model does not support shorter embeddings (its checkpoint declares no "
            f"Matryoshka dimensions); it returns {size} dimensions")
    if matryoshka and dimensions not in matryoshka:
        raise SamplingParamsError("dimensions", f"this model supports dimensions {list(matryoshka)}, not {dimensions}")


def format_embedding(vector: list[float], encoding_format: str, dimensions: int | None,
                     matryoshka: tuple[int, ...] | None = None) -> list[float] | str:
    """One vector as the API returns it (see the module docstring). `matryoshka`: the sizes the
    model allows (() any, None none)."""
    if dimensions is not None and dimensions != len(vector):
        check_dimensions(dimensions, len(vector), matryoshka)
        vector = vector[:dimensions]
        norm = math.sqrt(sum(x * x for x in vector))
        if norm > 0:
            vector = [x / norm for x in vector]
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def embedding_response(req: EmbeddingRequest, choices: list[ChoiceResult], model: str,
                       matryoshka: tuple[int, ...] | None = None) -> EmbeddingResponse:
    data = []
    for i, c in enumerate(choices):
        if c.embedding is None:
            raise GenerationFailed(f"input {i} finished without an embedding")
        data.append(EmbeddingData(index=i, embedding=format_embedding(c.embedding, req.encoding_format,
                                                                      req.dimensions, matryoshka)))
    tokens = sum(c.prompt_tokens for c in choices)
    return EmbeddingResponse(data=data, model=model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
