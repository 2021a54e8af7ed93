"""The OpenAI embeddings API (`POST /v1/embeddings`): request and response models, and how a
pooled vector is returned. The route itself lives with the others in `cluster.server`.

- `input`: a string, a list of strings, a token-id list or a list of token-id lists (at most
  `MAX_EMBEDDING_INPUTS`); none may be empty.
- `encoding_format`: "float" (a JSON list) or "base64" (the little-endian float32 bytes, as
  OpenAI encodes them; the `openai` client asks for base64 by default and decodes it).
- `dimensions`: keep the first d components and renormalise them to unit length (matryoshka
  truncation); larger than the model's embedding size is a 400.
- `usage`: prompt_tokens == total_tokens, the tokens of every input.
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Literal

from pydantic import BaseModel, ConfigDict

from cluster.client_api import ChoiceResult, GenerationFailed
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


def format_embedding(vector: list[float], encoding_format: str, dimensions: int | None) -> list[float] | str:
    """One vector as the API returns it (see the module docstring)."""
    if dimensions is not None:
        if dimensions > len(vector):
            raise SamplingParamsError(
                "dimensions", f"this model's embeddings have {len(vector)} dimensions; {dimensions} were requested"
            )
        vector = vector[:dimensions]
        norm = math.sqrt(sum(x * x for x in vector))
        if norm > 0:
            vector = [x / norm for x in vector]
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def embedding_response(req: EmbeddingRequest, choices: list[ChoiceResult], model: str) -> EmbeddingResponse:
    data = []
    for i, c in enumerate(choices):
        if c.embedding is None:
            raise GenerationFailed(f"input {i} finished without an embedding")
        data.append(EmbeddingData(index=i, embedding=format_embedding(c.embedding, req.encoding_format,
                                                                      req.dimensions)))
    tokens = sum(c.prompt_tokens for c in choices)
    return EmbeddingResponse(data=data, model=model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
