"""The one exception type that reaches users as a single line (see quantpipe.io.run_stage)."""


class UserError(Exception):
    """A mistake the user can fix: bad params, data or model. The message names what and how."""
