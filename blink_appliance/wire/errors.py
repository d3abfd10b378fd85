"""What the client raises when the engine cannot take a request now."""


class EngineBusyError(Exception):
    """No room right now (request ring, token arena, in-flight slots or logprob area full); retry later."""


class EngineDeadError(Exception):
    """The engine's heartbeat is stale or it is not running."""
