#!/usr/bin/env bash
# Where the AVX-512 int8 pass spends its time: the kernel built as it is and
# with one part stubbed out at a time (patch.py), each timed on 2^E
# parameters (default 26) at each thread count in THREADS (default 1 8 16),
# ROUNDS times in turn (default 1); "fp32 moments" is the same kernel's
# float32-moment pass. VARIANTS: "new" and its stubs joined by "-" (default
# below; e.g. new-nodiv-bf16cvt is NODIV and BF16CVT together), each timed
# with the int8 codes found each way in CODES (default "computed"; or
# "computed gather": JZO_INT8_CODES, which bench.cc reads). BASE: another
# commit's ext folder, built and stubbed the same way (its gathers), e.g.
#   git archive 092f856 ext | tar -x -C /tmp/base && BASE=/tmp/base/ext bash experiments/int8_stubs/run.sh
# Stubbed kernels compute wrong numbers: they are for timing only. Variants
# that compute the same bits another way (patch.py's second list) are
# checked first: CHECK=1 runs each on 2^20 parameters against the unpatched
# scalar kernel, bit for bit, before any timing.
cd "$(dirname "$0")"
flags="-O3 -std=c++17 -ffp-contract=off -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mavx2 -mfma -mf16c -w"
build() {  # NAME EXT-FOLDER STUBS...
  local name=$1 src=$2; shift 2
  python3 patch.py "$src" "/tmp/v-$name" "$@" &&
    g++ $flags -I"/tmp/v-$name" -c "/tmp/v-$name/adam_avx512.cc" -o "/tmp/v-$name.o" &&
    g++ -O3 -std=c++17 -I"/tmp/v-$name" bench.cc "/tmp/v-$name/quant8.cc" "/tmp/v-$name.o" \
      /tmp/scalar.o -o "/tmp/b-$name" -lpthread
}
g++ -O3 -std=c++17 -ffp-contract=off -I../../ext -c ../../ext/adam_scalar.cc -o /tmp/scalar.o
variants=${VARIANTS:-new new-noq new-nodeq new-nodiv new-bf16cvt new-nolowp}
for v in $variants; do build "$v" ../../ext $(echo "${v#new}" | tr - ' ' | tr a-z A-Z) & done
if [ -n "${BASE:-}" ]; then
  for v in base base-nogather base-bf16cvt; do
    build "$v" "$BASE" $(echo "${v#base}" | tr -d - | tr a-z A-Z) &
  done
  variants="base base-nogather base-bf16cvt $variants"
fi
wait
if [ -n "${CHECK:-}" ]; then
  for v in $variants; do
    for way in ${CODES:-computed}; do
      echo "check $v ($way): $(JZO_INT8_CODES=$way /tmp/b-$v 20 1 3 4 check) / fp32: $(/tmp/b-$v 20 0 3 4 check)"
    done
  done
fi
e=${E:-26}
for round in $(seq ${ROUNDS:-1}); do
for threads in ${THREADS:-1 8 16}; do
  reps=$([ "$threads" = 1 ] && echo 3 || echo 9)
  echo "threads $threads, 2^$e: fp32 moments $(/tmp/b-new "$e" 0 $reps "$threads")"
  for v in $variants; do
    for way in ${CODES:-computed}; do
      echo "threads $threads, 2^$e: int8 $v ($way) $(JZO_INT8_CODES=$way /tmp/b-$v "$e" 1 $reps "$threads")"
    done
  done
done
done
