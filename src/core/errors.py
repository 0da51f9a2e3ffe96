"""The one exception type for problems the user can fix."""


class UserError(Exception):
  """Bad input the user can fix; the message is one line that says how.

  The scripts print `error: <message>` and exit with status 2; no traceback
  is shown, and nothing in the output folder has been touched.
  """

  # Names the process of a multi-process run ("[2/4] "); printed first.
  prefix = ''
