//! Numbers as a YAML file (`murmur.yaml`, `fleet.yaml`) writes them: [`Int`], a whole number
//! of up to 128 bits, and [`Real`], any number. Both take whatever value the file holds, so
//! that a value out of range or of the wrong kind is refused by its field's rule (`must be at
//! most 4294967295, got …`, `must be a whole number, got 1.5`) rather than in serde's words.

use serde::Deserialize;
use std::fmt;

/// A whole number as written, of any size YAML holds (up to 128 bits), or the value a
/// whole number was expected in: a value past 64 bits is refused by its field's range
/// ([`Int::within`]: `must be at most 4294967295, got 99999999999999999999`) and a value
/// that is not a whole number by its field's rule (`must be a whole number, got 1.5`), never
/// in serde's words (`invalid type: integer `…` as u128, expected i64`, `invalid type:
/// floating point `1e27`, expected a whole number`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Int {
    /// A whole number.
    Whole(i128),
    /// A whole number past `i128::MAX` (YAML reads up to `u128::MAX`).
    Past(u128),
    /// Anything else, shown as YAML read it: `1.5`, `1e27`, `"5"` (a string, quoted),
    /// `true`, `a list`, `a mapping`.
    Other(String),
}

impl Int {
    /// The number as a `T` if it is in `min..=max`; else the rule it breaks, `must be at
    /// least <min>, got <n>`, `must be at most <max>, got <n>`, or `must be a whole number,
    /// got <value>`.
    pub(crate) fn within<T: Copy + Into<i128> + TryFrom<i128>>(&self, min: T, max: T) -> Result<T, String> {
        let (min, max) = (min.into(), max.into());
        match *self {
            Int::Other(ref shown) => Err(format!("must be a whole number, got {shown}")),
            Int::Past(n) => Err(format!("must be at most {max}, got {n}")),
            Int::Whole(n) if n < min => Err(format!("must be at least {min}, got {n}")),
            Int::Whole(n) if n > max => Err(format!("must be at most {max}, got {n}")),
            Int::Whole(n) => T::try_from(n).map_err(|_| format!("must be at most {max}, got {n}")),
        }
    }
}

impl<'de> Deserialize<'de> for Int {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Int, D::Error> {
        Ok(match Scalar::deserialize(deserializer)? {
            Scalar::Whole(n) => Int::Whole(n),
            Scalar::Past(n) => Int::Past(n),
            // Debug keeps an exponent as YAML may write it (`1e27`, not 28 digits).
            Scalar::Float(v) => Int::Other(format!("{v:?}")),
            Scalar::Other(shown) => Int::Other(shown),
        })
    }
}

/// A number as written (a whole number or a fraction), or the value a number was expected
/// in, so that a field's rule says what is wrong with it (`must be a number in (0, 1], got
/// "half"`) rather than serde (`invalid type: string "half", expected f64`). YAML reads a
/// number past `f64`'s range (`1e400`) as a string: it is shown quoted.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Real {
    /// A number (`.inf` and `.nan` included: the field's rule judges them).
    Number(f64),
    /// Anything else, shown as [`Int::Other`] is.
    Other(String),
}

impl Real {
    /// The number, when it is one.
    pub(crate) fn number(&self) -> Option<f64> {
        match *self {
            Real::Number(v) => Some(v),
            Real::Other(_) => None,
        }
    }
}

impl fmt::Display for Real {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Real::Number(v) => write!(f, "{v}"),
            Real::Other(shown) => f.write_str(shown),
        }
    }
}

impl<'de> Deserialize<'de> for Real {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Real, D::Error> {
        Ok(match Scalar::deserialize(deserializer)? {
            Scalar::Whole(n) => Real::Number(n as f64),
            Scalar::Past(n) => Real::Number(n as f64),
            Scalar::Float(v) => Real::Number(v),
            Scalar::Other(shown) => Real::Other(shown),
        })
    }
}

/// Any YAML value, sorted for [`Int`] and [`Real`].
enum Scalar {
    Whole(i128),
    Past(u128),
    Float(f64),
    /// Shown as YAML read it: a string quoted, `true`, `null`, `a list`, `a mapping`.
    Other(String),
}

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Scalar, D::Error> {
        struct Any;
        impl<'de> serde::de::Visitor<'de> for Any {
            type Value = Scalar;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a number")
            }
            fn visit_i64<E>(self, v: i64) -> Result<Scalar, E> {
                Ok(Scalar::Whole(v.into()))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Scalar, E> {
                Ok(Scalar::Whole(v.into()))
            }
            fn visit_i128<E>(self, v: i128) -> Result<Scalar, E> {
                Ok(Scalar::Whole(v))
            }
            fn visit_u128<E>(self, v: u128) -> Result<Scalar, E> {
                Ok(i128::try_from(v).map_or(Scalar::Past(v), Scalar::Whole))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Scalar, E> {
                Ok(Scalar::Float(v))
            }
            fn visit_bool<E>(self, v: bool) -> Result<Scalar, E> {
                Ok(Scalar::Other(v.to_string()))
            }
            fn visit_str<E>(self, v: &str) -> Result<Scalar, E> {
                Ok(Scalar::Other(format!("{v:?}")))
            }
            fn visit_unit<E>(self) -> Result<Scalar, E> {
                Ok(Scalar::Other("null".into()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Scalar, A::Error> {
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(Scalar::Other("a list".into()))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Scalar, A::Error> {
                while map.next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?.is_some() {}
                Ok(Scalar::Other("a mapping".into()))
            }
        }
        deserializer.deserialize_any(Any)
    }
}

#[cfg(test)]
mod tests {
    use super::Int;

    #[test]
    fn a_whole_number_is_read_up_to_128_bits_and_judged_by_its_range() {
        let read = |y: &str| serde_yaml_ng::from_str::<Int>(y).map_err(|e| e.to_string());
        assert_eq!(read("-5"), Ok(Int::Whole(-5)));
        assert_eq!(read("18446744073709551616"), Ok(Int::Whole(1 << 64)));
        assert_eq!(read("-99999999999999999999"), Ok(Int::Whole(-99_999_999_999_999_999_999)));
        assert_eq!(Int::Whole(7).within(0, 7), Ok(7));
        assert_eq!(Int::Whole(8).within(0, 7), Err("must be at most 7, got 8".into()));
        assert_eq!(Int::Whole(-1).within(0, 7), Err("must be at least 0, got -1".into()));
    }

    #[test]
    fn a_value_that_is_not_a_whole_number_is_refused_by_the_rule_not_by_serde() {
        let rule = |y: &str| serde_yaml_ng::from_str::<Int>(y).unwrap().within(0u32, 7).unwrap_err();
        for (yaml, shown) in [
            ("1.5", "1.5"),
            ("1e27", "1e27"),
            ("1000.0", "1000.0"),
            ("\"5\"", "\"5\""),
            ("1e400", "\"1e400\""),
            ("true", "true"),
            ("[1, 2]", "a list"),
            ("{a: 1}", "a mapping"),
        ] {
            assert_eq!(rule(yaml), format!("must be a whole number, got {shown}"), "{yaml}");
        }
        assert_eq!(
            rule("340282366920938463463374607431768211455"),
            "must be at most 7, got 340282366920938463463374607431768211455"
        );
    }
}
