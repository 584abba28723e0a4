"""The SDK's errors, shared by both clients (:mod:`envloop_pipelines.sdk.client` re-exports them)."""


class ClientError(RuntimeError):
    """A request the deployment refused, or an answer it could not give; the message says which and why."""


class PromotionOutOfReach(UserWarning):
    """The measured noise floor puts the bar above what the metric can still gain: no round can promote."""


class RefusedError(ClientError):
    """Bad input, refused before anything was launched or written (a hypothesis, a key, a kind): the message names the field."""


class NotFoundError(ClientError):
    """No such round, run, release or step at the deployment."""


class UnavailableError(ClientError):
    """The Dagster webserver or the MLflow server did not answer (within ``timeout_s``)."""


__all__ = ["ClientError", "NotFoundError", "PromotionOutOfReach", "RefusedError", "UnavailableError"]
