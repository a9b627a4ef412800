"""Writes the .npy and .npz fixtures of tests/test_npy.c with NumPy, which
is what makes them worth testing against: run it from this directory
(python3 make.py) and commit what it writes. Every value follows a formula
that test_npy.c computes too, so the test reads each file back bit for bit.
   k = the element's index in C order
   floats  ((37 k) mod 101 - 50) / 8, exact in float16, float32 and float64
   float64 also k / 10 (rounded once to float32 when loaded)
   uint8   (37 k + 11) mod 256
   int32   (7919 k) mod 100003 - 50000
   int64   2^40 + 12345 k (rounded to float32 when loaded as x)
   labels  (7 k + 3) mod 10
The .npz archives hold the time they were written (zip member dates), so a
rerun changes those bytes but no array; the tests read arrays, never dates.
(No NumPy here? python3 -m venv /tmp/venv && /tmp/venv/bin/pip install numpy)"""
import numpy as np
import numpy.lib.format as fmt

N = 5


def floats(shape, dtype):
    k = np.arange(int(np.prod(shape)), dtype=np.int64)
    return (((37 * k) % 101 - 50) / 8).astype(dtype).reshape(shape)


def labels(dtype):
    return ((7 * np.arange(N) + 3) % 10).astype(dtype)


def save(name, a, version=None):
    with open(name, "wb") as f:
        fmt.write_array(f, a, version=version, allow_pickle=True)


k15 = np.arange(15, dtype=np.int64)
save("x_f32.npy", floats((N, 2, 3), "<f4"))
save("x_f32_v2.npy", floats((N, 2, 3), "<f4"), version=(2, 0))
save("x_f32_v3.npy", floats((N, 2, 3), "<f4"), version=(3, 0))
save("x_f32_be.npy", floats((N, 2, 3), ">f4"))
save("x_f16.npy", floats((N, 6), "<f2"))
save("x_f64.npy", (np.arange(N * 3) / 10).reshape(N, 3).astype("<f8"))
save("x_u8.npy", ((37 * np.arange(N * 4) + 11) % 256).astype("|u1").reshape(N, 4))
save("x_i32.npy", ((7919 * k15) % 100003 - 50000).astype("<i4").reshape(N, 3))
save("x_i64.npy", (2**40 + 12345 * k15).astype("<i8").reshape(N, 3))
save("x_vec.npy", floats((N,), "<f4"))
save("y_i64.npy", labels("<i8"))
save("y_i64_be.npy", labels(">i8"))
save("y_i32.npy", labels("<i4"))
save("y_u8.npy", labels("|u1"))
save("y_f32.npy", floats((N, 2), "<f4"))
save("y_f16.npy", floats((N,), "<f2"))
save("y_4.npy", labels("<i8")[:4])

np.savez("data.npz", x_train=floats((N, 2, 3), "<f4"), y_train=labels("<i8"),
         note=np.arange(3))
np.savez_compressed("data_z.npz", x_train=floats((N, 2, 3), "<f4"), y_train=labels("<i8"))
np.savez("xy.npz", x=floats((N, 6), "<f2"), y=labels("|u1"))
np.savez_compressed("xy_z.npz", x=floats((N, 6), "<f2"), y=labels("|u1"))

# refused
save("fortran.npy", np.asfortranarray(floats((N, 3), "<f4")))
save("object.npy", np.array([1, "a", None], dtype=object))
save("structured.npy", np.zeros(N, dtype=[("a", "<f4"), ("b", "<i4")]))
save("complex.npy", np.zeros((N, 2), dtype="<c8"))
save("scalar.npy", np.array(3.0, dtype="<f4"))
save("y_negative.npy", np.array([0, 1, -1, 2, 3], dtype="<i8"))
save("y_too_large.npy", np.array([0, 1, 2**31, 2, 3], dtype="<i8"))
x_nan = floats((N, 3), "<f4")
x_nan[3, 1] = np.nan
save("x_nan.npy", x_nan)
