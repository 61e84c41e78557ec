"""`python -m tf_lars.cli ...`: the `tf-lars` command line."""

import sys

from tf_lars.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
