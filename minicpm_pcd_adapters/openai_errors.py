"""OpenAI's error body, which every non-2xx answer of `pcd serve` carries, and reading a request body
into its model with the error for one of the wrong shape (a leaf: no import from this package)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

Body = TypeVar("Body", bound=BaseModel)


class APIError(Exception):
    """An error answered with OpenAI's body: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def shape_error(error: ValidationError) -> APIError:
    """The 400 for a body of the wrong shape: the first error; an unknown parameter, or SGLang's
    `structural_tag` response format, named as such."""
    tagged = [
        e
        for e in error.errors()
        if e["loc"] == ("response_format", "type") and e["input"] == "structural_tag"
    ]
    if tagged:
        message = "response_format structural_tag is not supported: use a JSON schema, a regex or a grammar"
        return APIError(400, message, param="response_format.type", code="unsupported_parameter")
    first = error.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        return APIError(400, f"unsupported parameter: {param}", param=param, code="unsupported_parameter")
    return APIError(400, f"invalid {param}: {first['msg']}", param=param, code="invalid_value")


def read_body(model: type[Body], body: Any) -> Body:
    """A request body as `model` reads it: APIError (400) when it is not a JSON object or not of
    the model's shape (an unknown parameter named as such)."""
    if not isinstance(body, Mapping):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise shape_error(error) from None
