import os
import sys

# Before torch first allocates on a GPU: expandable segments grow one mapping instead of caching blocks of fixed
# sizes, so reserved memory stays close to allocated when shapes change (measured on an H100: 1B full fine-tune
# over variable-length padded batches reserved 29% above its allocated peak without it). A user's own setting wins.
from llmtune.plan.gpu_memory import ALLOC_CONF, EXPANDABLE_DEFAULT, allocator_setting  # torch-free

if allocator_setting(os.environ) is None:
    os.environ[ALLOC_CONF[0]] = EXPANDABLE_DEFAULT

from llmtune.train.worker import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
