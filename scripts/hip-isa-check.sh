#!/usr/bin/env bash
# hip-isa-check.sh — compile every HIP kernel family for every AMD target the installed hipcc
# supports, disassemble the code objects and check for the instructions the kernels are written
# to use, so a change that silently falls back to scalar code (or spills) fails CI.
#
# Needs Debian's `hipcc libamdhip64-dev rocm-device-libs` (which bring clang-15 and llvm-15's
# llvm-objdump). Targets: $EXPERTMESH_ISA_TARGETS or gfx908 gfx90a gfx940 gfx942 gfx1030 gfx1100;
# a target the compiler does not know is reported as skipped (at least one must build). A target
# without ROCm device libraries (gfx1100 on ROCm 5.2) is built with -nogpulib, like build.rs does.
#
# Checks per target (family: pattern that must appear in that kernel's disassembly):
#   decode      exact kernel: integer dot (v_dot4(c)_i32_i8 on gfx9/gfx10.3, v_dot4_i32_iu8 on gfx11)
#               and 16-byte weight loads (global_load_dwordx4 / global_load_b128)
#   prefill     MFMA i8 on gfx908/gfx90a (v_mfma_i32_16x16x16i8) and gfx94x (v_mfma_i32_16x16x32_i8),
#               WMMA iu8 on gfx11 (v_wmma_i32_16x16x16_iu8), integer dot elsewhere
#   all         no FMA contraction in the exact kernels' float math is checked by the host test;
#               here: no register spills in the exact kernels (vgpr_spill_count 0)
set -euo pipefail
cd "$(dirname "$0")/.."
HIPCC=${HIPCC:-hipcc}
OBJDUMP=${LLVM_OBJDUMP:-}
if [ -z "$OBJDUMP" ]; then
  for c in /usr/lib/llvm-15/bin/llvm-objdump /opt/rocm/llvm/bin/llvm-objdump llvm-objdump-15 llvm-objdump; do
    if command -v "$c" >/dev/null 2>&1; then OBJDUMP=$c; break; fi
  done
fi
READELF=${OBJDUMP%objdump}readelf
command -v "$HIPCC" >/dev/null || { echo "hip-isa-check: hipcc not found (apt-get install hipcc libamdhip64-dev rocm-device-libs)"; exit 2; }
[ -n "$OBJDUMP" ] || { echo "hip-isa-check: llvm-objdump not found (Debian: llvm-15, installed with hipcc)"; exit 2; }
TARGETS=${EXPERTMESH_ISA_TARGETS:-"gfx908 gfx90a gfx940 gfx942 gfx1030 gfx1100"}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
pass=0; fail=0; built=0
ok()  { echo "PASS $*"; pass=$((pass+1)); }
bad() { echo "FAIL $*"; fail=$((fail+1)); }

compile() { # target family nogpulib
  "$HIPCC" -x hip --cuda-device-only --no-gpu-bundle-output -c -O3 -std=c++17 -ffp-contract=off \
    -fno-gpu-flush-denormals-to-zero -Wall -Werror --offload-arch="$1" ${3:+-nogpulib} \
    "hip-kernels/kernels/$2.hip" -o "$WORK/$2-$1.co" 2>"$WORK/err-$2-$1.txt"
}

# Disassembly of one kernel symbol (from its label to the next s_endpgm).
kernel_asm() { # object kernel
  "$OBJDUMP" -d "$1" | awk -v k="<$2>:" '!done && $0 ~ k {on=1} on && !done {print} on && /s_endpgm/ {done=1}'
}

spills() { # object kernel -> vgpr_spill_count
  "$READELF" --notes "$1" | awk -v k="$2" '/\.name:/ {cur=$2} /\.vgpr_spill_count:/ && cur==k {print $2}'
}

for t in $TARGETS; do
  nogpulib=""
  if ! compile "$t" activations ""; then
    if grep -q "cannot find ROCm device library" "$WORK/err-activations-$t.txt"; then
      nogpulib=1
      compile "$t" activations 1 || { bad "$t activations: $(head -3 "$WORK/err-activations-$t.txt")"; continue; }
    elif grep -q "invalid target ID\|unknown target" "$WORK/err-activations-$t.txt"; then
      echo "SKIP $t: the installed hipcc does not support it"; continue
    else
      bad "$t activations: $(head -5 "$WORK/err-activations-$t.txt")"; continue
    fi
  fi
  built=$((built+1))
  for fam in decode prefill; do
    compile "$t" "$fam" "$nogpulib" || { bad "$t $fam compile: $(head -5 "$WORK/err-$fam-$t.txt")"; continue; }
  done
  case $t in
    gfx11*) dot='v_dot4_i32_iu8'; ld='global_load_b128' ;;
    *)      dot='v_dot4c?_i32_i8'; ld='global_load_dwordx4' ;;
  esac
  case $t in
    gfx908|gfx90a) mm='v_mfma_i32_16x16x16i8' ;;
    gfx94*|gfx950) mm='v_mfma_i32_16x16x32_i8' ;;
    gfx11*)        mm='v_wmma_i32_16x16x16_iu8' ;;
    *)             mm=$dot ;;
  esac
  [ -f "$WORK/decode-$t.co" ] && {
    asm=$(kernel_asm "$WORK/decode-$t.co" em_decode_exact)
    n=$(grep -cE "$dot" <<<"$asm" || true)
    [ "$n" -gt 0 ] && ok "$t decode exact uses $dot ($n)" || bad "$t decode exact: no $dot (scalar fallback?)"
    n=$(grep -cE "$ld" <<<"$asm" || true)
    [ "$n" -gt 0 ] && ok "$t decode exact uses 16-byte loads $ld ($n)" || bad "$t decode exact: no $ld"
    s=$(spills "$WORK/decode-$t.co" em_decode_exact)
    [ "${s:-x}" = 0 ] && ok "$t decode exact: no VGPR spills" || bad "$t decode exact: vgpr_spill_count=${s:-?}"
  }
  for k in em_prefill_exact_w13 em_prefill_exact_w2; do
    [ -f "$WORK/prefill-$t.co" ] || continue
    n=$(kernel_asm "$WORK/prefill-$t.co" $k | grep -cE "$mm" || true)
    [ "$n" -gt 0 ] && ok "$t $k uses $mm ($n)" || bad "$t $k: no $mm"
  done
done
[ "$built" -gt 0 ] || bad "no target could be built"
echo "hip-isa-check: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
