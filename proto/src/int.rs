//! [`Int`]: a whole number as a YAML file (`murmur.yaml`, `fleet.yaml`) writes it, of up to
//! 128 bits, so that a value past 64 bits is refused by its field's range rule rather than
//! in serde's words.

use serde::Deserialize;
use std::fmt;

/// A whole number as written, of any size YAML holds (up to 128 bits): a value past 64 bits
/// is refused by its field's range ([`Int::within`]: `must be at most 4294967295, got
/// 99999999999999999999`) rather than by the parser (`invalid type: integer `…` as u128,
/// expected i64`); anything but a whole number is refused as not one (`invalid type:
/// floating point `1.5`, expected a whole number`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Int(pub(crate) i128);

impl Int {
    /// The number as a `T` if it is in `min..=max`; else the rule it breaks, `must be at
    /// least <min>, got <n>` or `must be at most <max>, got <n>`.
    pub(crate) fn within<T: Copy + Into<i128> + TryFrom<i128>>(self, min: T, max: T) -> Result<T, String> {
        let (min, max) = (min.into(), max.into());
        match self.0 {
            n if n < min => Err(format!("must be at least {min}, got {n}")),
            n if n > max => Err(format!("must be at most {max}, got {n}")),
            n => T::try_from(n).map_err(|_| format!("must be at most {max}, got {n}")),
        }
    }
}

impl<'de> Deserialize<'de> for Int {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Int, D::Error> {
        struct Whole;
        impl serde::de::Visitor<'_> for Whole {
            type Value = Int;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a whole number")
            }
            fn visit_i64<E>(self, v: i64) -> Result<Int, E> {
                Ok(Int(v.into()))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Int, E> {
                Ok(Int(v.into()))
            }
            fn visit_i128<E>(self, v: i128) -> Result<Int, E> {
                Ok(Int(v))
            }
            fn visit_u128<E: serde::de::Error>(self, v: u128) -> Result<Int, E> {
                i128::try_from(v)
                    .map(Int)
                    .map_err(|_| E::custom(format_args!("must be at most {}, got {v}", i128::MAX)))
            }
        }
        deserializer.deserialize_any(Whole)
    }
}

#[cfg(test)]
mod tests {
    use super::Int;

    #[test]
    fn a_whole_number_is_read_up_to_128_bits_and_judged_by_its_range() {
        let read = |y: &str| serde_yaml_ng::from_str::<Int>(y).map_err(|e| e.to_string());
        assert_eq!(read("-5"), Ok(Int(-5)));
        assert_eq!(read("18446744073709551616"), Ok(Int(1 << 64)));
        assert_eq!(read("-99999999999999999999"), Ok(Int(-99_999_999_999_999_999_999)));
        assert_eq!(read("1.5").unwrap_err(), "invalid type: floating point `1.5`, expected a whole number");
        assert_eq!(Int(7).within(0, 7), Ok(7));
        assert_eq!(Int(8).within(0, 7), Err("must be at most 7, got 8".into()));
        assert_eq!(Int(-1).within(0, 7), Err("must be at least 0, got -1".into()));
    }
}
