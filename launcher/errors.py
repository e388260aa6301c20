"""The one exception type dslaunch shows to users as a single line."""


class LaunchError(Exception):
    """A wrong launch request (hostfile, --include/--exclude, flags, .dsenv file).

    `dslaunch` prints the message as one line, starts nothing and exits with status 2, like argparse
    does for a bad flag. The message names the file and line (or the flag) at fault.
    """

    exit_code = 2
