"""Worker script: Hugging Face's SageMaker data-parallel route (SM_FRAMEWORK_PARAMS), as far as it goes on a CPU."""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch.distributed as dist
from transformers import TrainingArguments
from transformers.utils import is_sagemaker_dp_enabled


def main() -> int:
    out: dict = {"sagemaker_dp": is_sagemaker_dp_enabled()}
    # What Trainer does with it in this mode (it raised TypeError when smddp-launch did not set it).
    out["smdataparallel_local_rank"] = int(os.getenv("SMDATAPARALLEL_LOCAL_RANK"))  # type: ignore[arg-type]
    try:
        args = TrainingArguments(output_dir=os.path.join(sys.argv[1], "hf"), report_to=[])
        out["device"] = str(args.device)
        out["stopped_at"] = None
    except Exception as e:  # accelerate's CUDA assumption on a CPU: recorded, see docs/torch.md
        out["stopped_at"] = f"{type(e).__name__}: {e}"
        out["where"] = traceback.extract_tb(e.__traceback__)[-1].name
    # accelerate's SageMaker route imported smdistributed...torch_smddp and started this group itself.
    out["backend"] = dist.get_backend() if dist.is_initialized() else None
    out["rank"] = dist.get_rank() if dist.is_initialized() else None
    out["world"] = dist.get_world_size() if dist.is_initialized() else None
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(out, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
