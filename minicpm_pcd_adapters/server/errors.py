"""OpenAI's error body (`ErrorBody`), which every non-2xx answer of `pcd serve` carries, and reading a
request body into its model with the error for one of the wrong shape (a leaf: no import from this
package)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar, get_args

from pydantic import BaseModel, ValidationError

Body = TypeVar("Body", bound=BaseModel)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error body, answered for every status other than 2xx."""

    error: ErrorDetail


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
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorBody(error=detail).model_dump(mode="json")


def shape_error(error: ValidationError, model: type[BaseModel] | None = None) -> APIError:
    """The 400 for a body of the wrong shape: the first error; an unknown parameter, or SGLang's
    `structural_tag` response format, named as such. An unknown top-level parameter that one of
    `model`'s objects takes (`abstain_below`, which goes in `"pcd": {...}`) is pointed there."""
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
        message = f"unsupported parameter: {param}"
        home = _nested_home(model, first["loc"])
        if home is not None:
            message += f'; it belongs in the "{home}" object: {{"{home}": {{"{param}": ...}}}}'
        return APIError(400, message, param=param, code="unsupported_parameter")
    return APIError(400, f"invalid {param}: {first['msg']}", param=param, code="invalid_value")


def read_body(model: type[Body], body: Any) -> Body:
    """A request body as `model` reads it: APIError (400) when it is not a JSON object or not of
    the model's shape (an unknown parameter named as such)."""
    if not isinstance(body, Mapping):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise shape_error(error, model) from None


def _nested_home(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> str | None:
    """The field of `model` whose object model takes the top-level key `loc[0]`, if any."""
    if model is None or len(loc) != 1:
        return None
    for name, info in model.model_fields.items():
        for kind in (info.annotation, *get_args(info.annotation)):
            if isinstance(kind, type) and issubclass(kind, BaseModel) and loc[0] in kind.model_fields:
                return name
    return None
