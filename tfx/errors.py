"""Errors a user can act on. Entry points print their message (no traceback) and exit 1."""


class UserError(ValueError):
  """Something in the config, the data or the workdir that the user must fix; the message says how."""


class DataError(UserError):
  """The data source, the corpus or the tokenizer cannot be used."""
