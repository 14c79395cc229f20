import sys

from llmtune.train.worker import main

sys.exit(main(sys.argv[1:]))
